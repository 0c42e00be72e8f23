"""The tasks of :mod:`coreai_torch.hf` and the model types each one exports."""

from __future__ import annotations

from coreai_torch.llm.export import ARCHITECTURES as CAUSAL_LM_TYPES

#: ``config.model_type`` of the encoders ``CoreAIModelForFeatureExtraction`` exports.
FEATURE_EXTRACTION_TYPES = (
    "albert",
    "bert",
    "camembert",
    "deberta-v2",
    "distilbert",
    "electra",
    "modernbert",
    "mpnet",
    "roberta",
    "xlm-roberta",
)
#: ``config.model_type`` of the speech models ``CoreAIModelForSpeechSeq2Seq`` exports.
SPEECH_SEQ2SEQ_TYPES = ("whisper",)
#: ``config.model_type`` of the vision-language models ``CoreAIModelForImageTextToText``
#: exports (their text decoder one of :data:`IMAGE_TEXT_DECODER_TYPES`).
IMAGE_TEXT_TO_TEXT_TYPES = ("llava",)
IMAGE_TEXT_DECODER_TYPES = ("llama", "mistral", "qwen2")

#: task -> model types
TASKS: dict[str, tuple[str, ...]] = {
    "text-generation": CAUSAL_LM_TYPES,
    "feature-extraction": FEATURE_EXTRACTION_TYPES,
    "automatic-speech-recognition": SPEECH_SEQ2SEQ_TYPES,
    "image-text-to-text": IMAGE_TEXT_TO_TEXT_TYPES,
}

#: task -> the class that runs it
CLASSES = {
    "text-generation": "CoreAIModelForCausalLM",
    "feature-extraction": "CoreAIModelForFeatureExtraction",
    "automatic-speech-recognition": "CoreAIModelForSpeechSeq2Seq",
    "image-text-to-text": "CoreAIModelForImageTextToText",
}


def suggest_task(model_type: str | None) -> str | None:
    """A hint naming the task (and class) that does export ``model_type``, or None."""
    for task, types in TASKS.items():
        if model_type in types:
            return f"a '{model_type}' model is exported with --task {task} ({CLASSES[task]})"
    return None


def register_pipeline_names() -> None:
    """Let ``transformers.pipeline`` recognise the ``CoreAIModelFor…`` classes for their
    tasks.  The text-generation and image-text-to-text pipelines check the model's class name
    against the names in ``transformers``' auto-model tables and log an error for any other;
    the classes are added there under their own keys, which name no configuration, so the
    auto classes never pick them."""
    from transformers.models.auto import modeling_auto

    for table, name in (
        ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "CoreAIModelForCausalLM"),
        ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "CoreAIModelForImageTextToText"),
    ):
        names = getattr(modeling_auto, table, None)
        if isinstance(names, dict):
            names.setdefault(f"coreai-{name}", name)


#: the task whose class loads a bundle of each kind (``metadata.json``'s ``kind``)
BUNDLE_TASKS = {"llm": "text-generation", "vlm": "image-text-to-text"}
