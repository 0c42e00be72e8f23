"""Large language models: static mixture-of-experts blocks (``rewrite_moe``)."""

from coreai_torch.llm.moe import rewrite_moe

__all__ = ["rewrite_moe"]
