"""Shared pieces of the ``coreai_torch.hf`` tests: the step-by-step comparison of a
``generate`` on the runtime with Hugging Face's, and model directories saved here.

Nothing is downloaded: models are built from config classes with random weights and saved
with ``save_pretrained`` into temporary directories; tokenizers are trained here.
"""

from __future__ import annotations

from typing import Any

import torch

#: fp32 logits agree within this many times max(1, max|ref|) at every step.
TOLERANCE = 1e-4


def check_generate(
    ours: Any, reference: Any, inputs: dict[str, Any], new_tokens: int = 16, **kwargs: Any
) -> torch.Tensor:
    """Greedy ``generate`` of ``ours`` equals ``reference.generate`` token for token, and each
    step's logits are within :data:`TOLERANCE`; returns the sequences."""
    args = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    with torch.no_grad():
        expected = reference.generate(**inputs, **args)
    actual = ours.generate(**inputs, **args)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    assert len(actual.logits) == len(expected.logits) == new_tokens
    for step, (a, e) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        tol = TOLERANCE * max(1.0, float(e.abs().max()))
        err = float((a - e).abs().max())
        assert err <= tol, f"step {step}: max|err| {err:.3e} > {tol:.3e}"
    return actual.sequences
