"""diffusers pipelines on Core AI: export a local pipeline directory (one program per
component, streamed from its safetensors checkpoints), run it like diffusers with
:class:`CoreAIDiffusionPipeline`, ship it as a diffusion bundle for the Swift
``CoreAIDiffusionPipeline`` (docs/text_to_image.md)."""

from coreai_torch.diffusers.components import FAMILIES, supported_pipelines
from coreai_torch.diffusers.export import export_pipeline
from coreai_torch.diffusers.pipeline import CoreAIDiffusionPipeline

__all__ = ["FAMILIES", "CoreAIDiffusionPipeline", "export_pipeline", "supported_pipelines"]
