"""The exceptions coreai-torch raises.

Every conversion problem is a :class:`ConversionError` (or a subclass).  Errors about
arguments the caller passed are also ``ValueError``/``TypeError`` so that generic handlers
keep working.  Messages say what is wrong, where (op, FX node, user source line) and what
to do about it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class ConversionError(Exception):
    """A PyTorch program could not be converted to a Core AI program."""


class NotDecomposedError(ConversionError, ValueError):
    """The exported program was not decomposed with ``run_decompositions()``."""


class UnsupportedOpError(ConversionError):
    """The program contains ops that have no lowering (all of them are listed at once)."""

    def __init__(self, message: str, ops: Mapping[str, Sequence[object]] | None = None) -> None:
        super().__init__(message)
        #: qualified op name -> FX nodes that use it
        self.ops: dict[str, Sequence[object]] = dict(ops or {})


class LoweringError(ConversionError):
    """A lowering rule failed (raised, returned nothing or the wrong values) for one node."""


class InvalidSignatureError(ConversionError, ValueError):
    """Input, output, state or entry point names are invalid (count, duplicates, collisions)."""


class VerificationError(ConversionError):
    """The generated program failed the MLIR verifier; the message names the offending op."""


class RuntimeHazardError(ConversionError):
    """The program would crash the Core AI runtime (e.g. zero-element tensors) if it ran."""


class UnsupportedPlatformError(RuntimeError):
    """The program is valid but this platform's Core AI runtime cannot run it (e.g. Metal
    kernels outside Apple GPUs)."""


class ExternalizationError(ConversionError, ValueError):
    """``externalize_modules`` cannot be honoured (bad spec, forward arguments or attributes)."""


class UnsupportedModelError(ConversionError, ValueError):
    """``coreai_torch.llm.export`` cannot export this model (not a causal LM of a supported
    architecture)."""


class UnsupportedMoEError(ConversionError, TypeError):
    """``rewrite_moe`` met a mixture-of-experts block whose routing it cannot reproduce
    exactly (the message names the class and lists the supported ones)."""


class InvalidAssetError(ValueError):
    """A saved Core AI asset is incomplete, damaged or malformed (the message names the file
    and the problem); raised before the Core AI runtime reads it."""


class AssetNotFoundError(InvalidAssetError, FileNotFoundError):
    """The path given as a Core AI asset does not exist."""


class NonFiniteWeightError(ValueError):
    """``compress()`` met weights holding NaN or infinite values (the message names each
    weight, the counts and the first positions)."""


class CheckpointError(ConversionError, ValueError):
    """A checkpoint cannot provide a model's weights: a missing or truncated file, a missing
    tensor, or a shape that disagrees with the model (the message names the file and the
    tensor)."""


class BundleError(ValueError):
    """A Core AI bundle (the directory Apple's app runtimes load) that the app could not load,
    or a request to write one: the message names the file, the key or the asset, what is wrong
    and the fix."""


class BundleNotFoundError(BundleError, FileNotFoundError):
    """A bundle directory, its ``metadata.json`` or a file it names does not exist."""


class CallingConventionError(BundleError):
    """An asset whose functions, inputs, outputs or states do not follow the calling
    convention of the app engine that would run it (the message names the function, the
    value and the rule)."""
