"""Known failures of the OpInfo sweep — data, not code.

``EXPECTED_FAILURES`` maps an OpInfo id (``name`` or ``name.variant``) to the reason it fails,
either for every swept dtype (a string) or per dtype (``{"float32": "...", "bool": "..."}``).
The sweep's tests are strict xfails: when a fix makes an entry pass, the test reports an
unexpected pass and the entry must be removed here.  ``python -m tests.opinfo.sweep --check``
lists the differences between this table and a sweep's results.

``TOLERANCES`` widens the float comparison ``(atol, rtol)`` for entries whose PyTorch reference
itself is computed differently (say why next to each entry).
"""

from __future__ import annotations

from coreai_torch import torch_compat

_COMPLEX = "complex numbers: Core AI has no complex dtype"
_CUDA_ONLY = "CUDA-only op: no CPU kernel to compare with"
_SPARSE = "sparse tensors: PyTorch cannot run the samples on CPU"

EXPECTED_FAILURES: dict[str, str | dict[str, str]] = {
    "_batch_norm_with_update": (
        "its samples return the op's empty reserve tensor: zero elements, rejected"
    ),
    "allclose": "torch.export cannot export it (data-dependent output of allclose)",
    "bincount": "no lowering for bincount",
    "cdouble": _COMPLEX,
    "cfloat": _COMPLEX,
    "chalf": _COMPLEX,
    "complex": _COMPLEX,
    "corrcoef": "torch.export cannot export it (data-dependent output of equal)",
    "cov": "torch.export cannot export it (data-dependent output of equal)",
    "equal": "torch.export cannot export it (data-dependent output of equal)",
    "fft.fft": _COMPLEX,
    "fft.fft2": _COMPLEX,
    "fft.fftn": _COMPLEX,
    "fft.hfft": _COMPLEX,
    "fft.hfft2": _COMPLEX,
    "fft.hfftn": _COMPLEX,
    "fft.ifft": _COMPLEX,
    "fft.ifft2": _COMPLEX,
    "fft.ifftn": _COMPLEX,
    "fft.ihfft": _COMPLEX,
    "fft.ihfft2": _COMPLEX,
    "fft.ihfftn": _COMPLEX,
    "fft.irfft": _COMPLEX,
    "fft.irfft2": _COMPLEX,
    "fft.irfftn": _COMPLEX,
    "fft.rfft": _COMPLEX,
    "fft.rfft2": _COMPLEX,
    "fft.rfftn": _COMPLEX,
    "jiterator_2inputs_2outputs": _CUDA_ONLY,
    "jiterator_4inputs_with_extra_args": _CUDA_ONLY,
    "jiterator_binary": _CUDA_ONLY,
    "jiterator_binary_return_by_ref": _CUDA_ONLY,
    "jiterator_unary": _CUDA_ONLY,
    "linalg.eig": _COMPLEX,
    "linalg.eigvals": _COMPLEX,
    "linalg.lstsq": "torch.export cannot export it (dynamic output shape of linalg_lstsq)",
    "linalg.lstsq.grad_oriented": (
        "torch.export cannot export it (dynamic output shape of linalg_lstsq)"
    ),
    "linalg.svd": "full_matrices=True on non-square matrices is not lowered",
    "nn.functional.ctc_loss": "torch.export cannot export it (dynamic output shape of _ctc_loss)",
    "nn.functional.gaussian_nll_loss": (
        "torch.export cannot export it (guard on a data-dependent value)"
    ),
    "polar": _COMPLEX,
    "repeat_interleave": "no lowering for repeat_interleave.Tensor",
    "resize_as_": "no lowering for resize",
    "sparse.mm.reduce": _SPARSE,
    "sparse.sampled_addmm": _SPARSE,
    "stft": _COMPLEX,
    "to_sparse": "sparse tensors: Core AI has dense tensors only",
    "unique": "no lowering for _unique2, unique_dim",
    "unique_consecutive": "no lowering for unique_consecutive",
    "view_as_complex": _COMPLEX,
}

if not torch_compat.EXPORTS_COMBINATIONS:  # torch 2.12, 2.13
    EXPECTED_FAILURES["combinations"] = (
        "torch.export cannot export it before torch 2.14 (masked_select has a data-dependent "
        "output size)"
    )

TOLERANCES: dict[str, tuple[float, float]] = {}
