"""Hugging Face models as users run them, on the Core AI runtime: ``CoreAIModelFor…``
classes with ``from_pretrained`` / ``save_pretrained``, ``generate`` and
``transformers.pipeline`` support.

    from coreai_torch.hf import CoreAIModelForCausalLM
    model = CoreAIModelForCausalLM.from_pretrained("model_dir", export=True, precision="fp16",
                                                   compress="int4")
    model.save_pretrained("out_dir")   # .aimodel + config.json + tokenizer files
    model = CoreAIModelForCausalLM.from_pretrained("out_dir")   # no export, no torch weights

The classes are imported on first use (``transformers`` is imported then).  See
``docs/hf_*.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

from coreai_torch.hf.tasks import TASKS

#: public name -> the module defining it
_EXPORTS = {
    "CoreAIModel": "coreai_torch.hf.base",
    "CoreAIModelForCausalLM": "coreai_torch.hf.causal_lm",
    "RuntimeCache": "coreai_torch.hf.causal_lm",
    "CoreAIModelForFeatureExtraction": "coreai_torch.hf.feature_extraction",
    "pool": "coreai_torch.hf.feature_extraction",
    "CoreAIModelForImageTextToText": "coreai_torch.hf.image_text_to_text",
    "CoreAIModelForSpeechSeq2Seq": "coreai_torch.hf.speech_seq2seq",
}

__all__ = ["TASKS", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'coreai_torch.hf' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
