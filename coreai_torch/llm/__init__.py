"""Language models end to end: a Hugging Face causal LM -> a Core AI program in the calling
convention of Apple's app runtimes (:func:`export`, in float32, float16 or bfloat16, with
compressed weights or not; with ``bundle=`` the bundle the app loads) -> text generation on
the runtime (:class:`Generator`); mixture-of-experts blocks made static (:func:`rewrite_moe`,
which :func:`export` applies by itself).

    coreai_torch.llm.export("path/to/model_dir", max_context=1024, precision="fp16",
                            compress="int4", bundle="out/MyModel")   # all optional but bundle
    with coreai_torch.llm.Generator("out/MyModel") as gen:           # its tokenizer too
        for token in gen.generate("Once upon a time", max_new_tokens=32):
            ...
        print(gen.stats)  # prefill and decode tokens/s

See ``docs/llm.md``, ``docs/bundles.md`` and ``docs/frontier_models.md``.
"""

from coreai_torch.errors import UnsupportedModelError
from coreai_torch.llm.export import ARCHITECTURES, ENGINES, MOE_ARCHITECTURES, export
from coreai_torch.llm.generate import GenerationStats, Generator
from coreai_torch.rewrites.moe import rewrite_moe

__all__ = [
    "ARCHITECTURES",
    "ENGINES",
    "MOE_ARCHITECTURES",
    "GenerationStats",
    "Generator",
    "UnsupportedModelError",
    "export",
    "rewrite_moe",
]
