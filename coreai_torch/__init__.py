"""coreai-torch: convert PyTorch programs into Core AI programs.

ep = torch.export.export(model, args).run_decompositions(coreai_torch.get_decomp_table())
program = coreai_torch.TorchConverter().add_exported_program(ep).to_coreai()
program.optimize().save_asset(Path("model.aimodel"))

TorchConverter(compute_precision=torch.float16) converts into a half-precision program
(coreai_torch.precision, docs/precision.md); coreai_torch.verify.verify(model, args) converts,
runs and compares with eager PyTorch.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _distribution_version

from coreai_torch import (
    _utils,  # noqa: F401  (coreai_torch._utils.get_operand for lowerings)
    composite_ops,
    compression,
    errors,
    llm,
    precision,
    progress,
    torch_compat,
    verify,
)
from coreai_torch._compression import ops as _coreai_ops  # noqa: F401  (torch.ops.coreai.*)
from coreai_torch.analysis import analyze
from coreai_torch.compression.apply import CompressionReport
from coreai_torch.converter import TorchConverter
from coreai_torch.errors import (
    AssetNotFoundError,
    CheckpointError,
    ConversionError,
    ExternalizationError,
    InvalidAssetError,
    InvalidSignatureError,
    LoweringError,
    NonFiniteWeightError,
    NotDecomposedError,
    RuntimeHazardError,
    UnsupportedModelError,
    UnsupportedMoEError,
    UnsupportedOpError,
    UnsupportedPlatformError,
    VerificationError,
)
from coreai_torch.frontend.export import get_decomp_table
from coreai_torch.frontend.externalize import ExternalizeSpec
from coreai_torch.importer.metal import MetalParameter, TorchMetalKernel
from coreai_torch.ir.composite import generate_composite_decl
from coreai_torch.program import AIProgram
from coreai_torch.rewrites.moe import rewrite_moe
from coreai_torch.rewrites.recurrent import rewrite_recurrent
from coreai_torch.tensors.lazy import WeightSource, empty_parameters

try:
    #: The installed distribution's version (pyproject.toml's ``version``).
    __version__ = _distribution_version("coreai-torch-converter")
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

torch_compat.warn_if_untested_torch()

__all__ = [
    "AIProgram",
    "AssetNotFoundError",
    "CheckpointError",
    "CompressionReport",
    "ConversionError",
    "ExternalizationError",
    "ExternalizeSpec",
    "InvalidAssetError",
    "InvalidSignatureError",
    "LoweringError",
    "MetalParameter",
    "NonFiniteWeightError",
    "NotDecomposedError",
    "RuntimeHazardError",
    "TorchConverter",
    "TorchMetalKernel",
    "UnsupportedMoEError",
    "UnsupportedModelError",
    "UnsupportedOpError",
    "UnsupportedPlatformError",
    "VerificationError",
    "WeightSource",
    "analyze",
    "composite_ops",
    "compression",
    "empty_parameters",
    "errors",
    "generate_composite_decl",
    "get_decomp_table",
    "llm",
    "precision",
    "progress",
    "rewrite_moe",
    "rewrite_recurrent",
    "verify",
]
