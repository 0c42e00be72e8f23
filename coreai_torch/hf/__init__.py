"""Hugging Face models as users run them, on the Core AI runtime: ``CoreAIModelFor…``
classes with ``from_pretrained`` / ``save_pretrained``, ``generate`` and
``transformers.pipeline`` support.

    from coreai_torch.hf import CoreAIModelForCausalLM
    model = CoreAIModelForCausalLM.from_pretrained("model_dir", export=True, precision="fp16",
                                                   compress="int4")
    model.save_pretrained("out_dir")   # .aimodel + config.json + tokenizer files
    model = CoreAIModelForCausalLM.from_pretrained("out_dir")   # no export, no torch weights

See ``docs/hf_*.md``.
"""

from coreai_torch.hf.base import CoreAIModel
from coreai_torch.hf.causal_lm import CoreAIModelForCausalLM, RuntimeCache
from coreai_torch.hf.feature_extraction import CoreAIModelForFeatureExtraction, pool
from coreai_torch.hf.image_text_to_text import CoreAIModelForImageTextToText
from coreai_torch.hf.speech_seq2seq import CoreAIModelForSpeechSeq2Seq
from coreai_torch.hf.tasks import TASKS, register_pipeline_names

register_pipeline_names()

__all__ = [
    "TASKS",
    "CoreAIModel",
    "CoreAIModelForCausalLM",
    "CoreAIModelForFeatureExtraction",
    "CoreAIModelForImageTextToText",
    "CoreAIModelForSpeechSeq2Seq",
    "RuntimeCache",
    "pool",
]
