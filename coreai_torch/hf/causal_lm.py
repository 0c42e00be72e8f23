"""``CoreAIModelForCausalLM``: a Hugging Face causal LM on the Core AI runtime, with
``generate`` (``transformers``' ``GenerationMixin``), ``model(**inputs)`` and the
``text-generation`` pipeline.

The program is :func:`coreai_torch.llm.export`'s: the function ``main`` of Apple's app
engines (int32 ``input_ids [1, T]`` and ``position_ids [1, P]``, float16 logits of every new
token, the KV cache in two states that grow; :mod:`coreai_torch.llm.decoder`).
``save_pretrained`` writes the bundle the app loads (``docs/bundles.md``) with the Hugging
Face configs beside it, and ``from_pretrained`` loads such bundles, those of
``llm.export(..., bundle=...)`` and Apple's own language bundles.

A batch runs row by row, each row with its own cache buffers; left padding (from the
attention mask) is dropped, so a padded row computes exactly what the unpadded one does.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
import torch.nn as nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from coreai_torch.bundles import is_bundle_dir
from coreai_torch.hf.base import (
    COREAI_CONFIG,
    FORMAT_VERSION,
    CoreAIModel,
    checked_config,
    class_for_task,
    load_generation_config,
    read_coreai_config,
)
from coreai_torch.hf.tasks import BUNDLE_TASKS, CAUSAL_LM_TYPES

#: generation modes ``generate`` supports (``GenerationMode`` values)
SUPPORTED_GENERATION_MODES = ("greedy_search", "sample", "beam_search", "beam_sample")


def export_causal_lm(
    model: nn.Module,
    max_context: int,
    precision: Any = None,
    compress: Any = None,
    *,
    restore: bool = True,
    calibration: Any = None,
    target_bpw: float | None = None,
) -> Any:
    """The ``AIProgram`` of a ``transformers`` causal LM: ``main`` in the app engines'
    calling convention (:func:`coreai_torch.llm.export.convert_causal_lm`; a model that
    :func:`~coreai_torch.llm.export.load_causal_lm` streams from its checkpoint is read one
    weight at a time while the asset is written).  ``calibration``: token ids
    ``[samples, tokens]`` the compressed weights are fitted against; ``target_bpw``: the
    budget of ``compress="mixed"``."""
    from coreai_torch.llm.export import (
        check_max_context,
        compression_config,
        convert_causal_lm,
        precision_policy,
    )

    policy = precision_policy(precision)
    compression = compression_config(compress, target_bpw, calibration)
    check_max_context(model, max_context)
    return convert_causal_lm(
        model,
        max_context,
        policy,
        compression,
        restore=restore,
        calibration=calibration,
    )


def describe_options(
    precision: Any, compress: Any, target_bpw: float | None = None, calibration: Any = None
) -> dict[str, Any]:
    """``precision`` / ``compression`` as recorded in ``coreai_config.json``."""
    from coreai_torch.llm.export import compression_config, precision_policy

    policy = precision_policy(precision)
    compression = compression_config(compress, target_bpw, calibration)
    return {
        "precision": policy.name,
        "compression": compression.describe() if compression is not None else None,
    }


def compression_meta(program: Any) -> dict[str, Any]:
    """The measured size and output error of a compressed program, for ``coreai_config.json``
    (nothing for an uncompressed one)."""
    report = getattr(program, "compression_report", None)
    if report is None:
        return {}
    return {"bits_per_weight": report.bits_per_weight, "output_error": report.output_error}


def check_generation_mode(model: Any, kwargs: dict[str, Any]) -> None:
    """Raise ``NotImplementedError`` (before anything runs) unless ``generate(**kwargs)``
    would use one of :data:`SUPPORTED_GENERATION_MODES`."""
    args = dict(kwargs)
    config, _ = model._prepare_generation_config(
        args.pop("generation_config", None), args.pop("use_model_defaults", None), **args
    )
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    mode = getattr(mode, "value", mode)
    if mode not in SUPPORTED_GENERATION_MODES:
        raise NotImplementedError(
            f"{type(model).__name__}.generate supports greedy search, sampling and beam search "
            f"(no assistant model, beam groups, constraints, contrastive search or DoLa); "
            f"'{mode}' is not supported"
        )


class RuntimeCache:
    """The KV caches of one generation: a set of runtime state buffers per batch row, and
    how many tokens each row holds.  ``generate`` passes it around as ``past_key_values``."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        #: real (unpadded) tokens each row's cache holds
        self.lengths = [0] * len(rows)
        #: input columns (padding included) consumed so far
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def __len__(self) -> int:
        return len(self.rows)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` continues row ``beam_idx[i]`` (beam search): its buffers are copied."""
        from coreai.runtime import NDArray

        from coreai_torch.runtime import to_numpy

        order = [int(i) for i in beam_idx]
        self.rows = [
            {name: NDArray(to_numpy(value).copy()) for name, value in self.rows[i].items()}
            for i in order
        ]
        self.lengths = [self.lengths[i] for i in order]


class CoreAICausalLMBase(CoreAIModel):
    """The prefill / decode loop over a KV cache held as runtime state (shared with the
    vision-language class)."""

    #: the asset holding the ``prefill`` / ``decode`` entry points
    _decoder_asset = "model"

    def _new_cache(self, batch_size: int, positions: int = 0) -> RuntimeCache:
        """A cache of ``batch_size`` rows, each with room for ``positions`` positions (where
        the states grow)."""
        return RuntimeCache(
            [self._fresh_states(self._decoder_asset, "decode") for _ in range(batch_size)]
        )

    # -- GenerationMixin hooks ----------------------------------------------------------------

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        check_generation_mode(self, kwargs)
        return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(
        self,
        generation_config: Any,
        model_kwargs: dict,
        generation_mode: Any,
        batch_size: int,
        max_cache_length: int,
    ) -> None:
        if model_kwargs.get("past_key_values") is not None:
            if not isinstance(model_kwargs["past_key_values"], RuntimeCache):
                raise TypeError(
                    f"{type(self).__name__}.generate takes past_key_values only as the "
                    f"RuntimeCache a previous call returned, got "
                    f"{type(model_kwargs['past_key_values']).__name__}"
                )
            return
        extra = self._extra_cache_positions(model_kwargs)
        needed = max_cache_length + extra
        if self.max_context is not None and needed > self.max_context:
            raise ValueError(
                f"generating up to max_length={generation_config.max_length} tokens (prompt "
                f"included) needs a context of {needed} positions; the model was exported with "
                f"max_context={self.max_context}: export with a larger max_context, or shorten "
                "the prompt or max_new_tokens"
            )
        generation_config.use_cache = True  # the runtime's cache is always used
        # rows once generate has expanded the inputs for beams / returned sequences
        expand = max(generation_config.num_beams, generation_config.num_return_sequences)
        model_kwargs["past_key_values"] = self._new_cache(batch_size * expand, needed)

    def _extra_cache_positions(self, model_kwargs: dict) -> int:
        """Cache positions taken beyond the token ids (image tokens expanded, ...)."""
        return 0

    # -- running the decoder ------------------------------------------------------------------

    def _run_rows(
        self,
        cache: RuntimeCache,
        rows: list[tuple[Any, int]],
        all_logits: bool,
    ) -> list[np.ndarray]:
        """Feed each row's new inputs (token ids ``[n]`` or embeddings ``[n, hidden]``) to its
        cache; returns each row's logits (``[n, vocab]`` with ``all_logits``, else
        ``[1, vocab]``).  Every row is checked before the first runs."""
        for r, (_, n) in enumerate(rows):
            if self.max_context is not None and cache.lengths[r] + n > self.max_context:
                raise ValueError(
                    f"row {r}: {cache.lengths[r]} cached + {n} new tokens exceed the model's "
                    f"max_context={self.max_context} (export with a larger max_context, or "
                    "shorten the prompt)"
                )
        if all_logits and not self._returns_all_logits():
            raise ValueError(
                "this model was exported without the 'forward' entry point (every position's "
                "logits); pass logits_to_keep=1 or export it again"
            )
        results = []
        for r, (values, n) in enumerate(rows):
            start = cache.lengths[r]
            results.append(self._step(values, n, start, cache.rows[r], all_logits))
            cache.lengths[r] += n
        return results

    def _step(
        self, ids: Any, n: int, start: int, states: dict[str, Any], all_logits: bool
    ) -> np.ndarray:
        entry = "decode" if n == 1 else ("forward" if all_logits else "prefill")
        out = self._run(
            self._decoder_asset,
            entry,
            {
                "input_ids": np.asarray(ids, np.int64).reshape(1, n),
                "start_position": np.asarray([start], np.int64),
            },
            state=states,
        )
        return out["logits"][0]

    def _returns_all_logits(self) -> bool:
        """Whether the program can return the logits of every position."""
        return "forward" in self.sessions[self._decoder_asset].model.function_names


def split_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, seen: int, lengths: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per row: ``(kept column indices, ids)`` of the new columns whose mask is 1.  Padding
    must come first (left padding): a row with a masked column after a real token raises."""
    batch, new = input_ids.shape
    if attention_mask is None:
        keep = torch.ones(batch, new, dtype=torch.bool)
    else:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch:
            raise ValueError(
                f"attention_mask must be [batch, sequence] = [{batch}, {seen + new}], got "
                f"{list(attention_mask.shape)}"
            )
        if attention_mask.shape[1] == seen + new:
            mask = attention_mask[:, seen:]
        elif attention_mask.shape[1] == new:
            mask = attention_mask
        else:
            raise ValueError(
                f"attention_mask has {attention_mask.shape[1]} columns; the cache holds {seen} "
                f"and input_ids adds {new}: expected {seen + new}"
            )
        keep = mask.bool()
    rows = []
    for r in range(batch):
        cols = torch.nonzero(keep[r]).flatten()
        first = int(cols[0]) if len(cols) else new
        holes = (cols.numel() and int(cols[-1]) - first + 1 != cols.numel()) or (
            lengths[r] > 0 and first > 0
        )
        if holes or (len(cols) and int(cols[-1]) != new - 1):
            raise ValueError(
                f"attention_mask row {r} masks a token after a real one (right padding or a "
                "hole); only left padding is supported: tokenize with padding_side='left'"
            )
        if not len(cols) and lengths[r] == 0:
            raise ValueError(f"attention_mask row {r} masks every token of the prompt")
        rows.append((cols, input_ids[r, cols]))
    return rows


class CoreAIModelForCausalLM(CoreAICausalLMBase, GenerationMixin):
    """A Hugging Face causal LM (Llama, Qwen2/3, Mistral, Gemma 1-3, Phi-3, mixtures of
    experts, …) exported to a Core AI program in the app engines' calling convention and run
    on the Core AI runtime::

        model = CoreAIModelForCausalLM.from_pretrained("model_dir", export=True)
        model.save_pretrained("out/MyModel")        # the bundle Apple's app runtimes load
        model = CoreAIModelForCausalLM.from_pretrained("out/MyModel")  # no torch weights
        out = model.generate(**tokenizer("Hi", return_tensors="pt"), max_new_tokens=32)
        pipeline("text-generation", model=model, tokenizer=tokenizer)

    ``generate`` is ``transformers``' (greedy search, sampling, beam search; assisted,
    contrastive and constrained generation raise).  ``model(**inputs)`` returns
    ``CausalLMOutputWithPast`` with the logits of every position (or the last, with
    ``logits_to_keep=1``) and the runtime cache as ``past_key_values``.
    """

    task = "text-generation"
    #: the kind of bundle the class writes and loads
    bundle_kind = "llm"

    @classmethod
    def _export_model(
        cls,
        source: PreTrainedModel | Path,
        *,
        max_context: int | None,
        precision: Any,
        compress: Any,
        calibration: Any = None,
        target_bpw: float | None = None,
    ) -> Self:
        from coreai_torch.llm.export import (
            calibration_input,
            default_max_context,
            load_causal_lm,
        )

        # bad options fail before loading
        describe = describe_options(precision, compress, target_bpw, calibration)
        checked_config(source, CAUSAL_LM_TYPES, cls.__name__)
        # a directory's weights stay in its checkpoint until the asset is written
        restore = not isinstance(source, Path)
        model = load_causal_lm(source)
        if max_context is None:
            max_context = default_max_context(model.config)
        program = export_causal_lm(
            model,
            max_context,
            precision,
            compress,
            restore=restore,
            calibration=calibration_input(model, source, calibration),
            target_bpw=target_bpw,
        )
        meta = {"max_context": max_context, **describe, **compression_meta(program)}
        return cls._from_programs(model, {"model": program}, meta, source)

    # -- bundles ------------------------------------------------------------------------------

    @classmethod
    def _load(cls, path: Path, *, verify_hash: bool = True) -> CoreAIModelForCausalLM:
        if not is_bundle_dir(path):
            if (path / COREAI_CONFIG).is_file():
                task = read_coreai_config(path, check_assets=False).get("task")
                if task != cls.task:  # another task's directory: the base names its class
                    return super()._load(path, verify_hash=verify_hash)
            raise ValueError(
                f"{path} was saved by an earlier coreai-torch in its own format (prefill/decode "
                "entry points, int64 ids), which this one no longer runs; export the model "
                f"again, e.g. coreai-torch export --task {cls.task} HF_MODEL_DIR -o {path}.new "
                f"(or {cls.__name__}.from_pretrained(hf_model_dir, "
                f"export=True).save_pretrained('{path}.new')), to write the bundle Apple's app "
                "runtimes load"
            )
        return cls._load_bundle(path, verify_hash=verify_hash)

    @classmethod
    def _load_bundle(cls, path: Path, *, verify_hash: bool = True) -> CoreAIModelForCausalLM:
        """A language bundle (``metadata.json``): ours, ``llm.export``'s or Apple's."""
        from coreai_torch.bundles import Bundle

        bundle = Bundle.load(path)
        if bundle.kind != cls.bundle_kind:
            task = BUNDLE_TASKS.get(bundle.kind)
            loader = class_for_task(task).__name__ if task else None
            raise ValueError(
                f"{path} is a '{bundle.kind}' bundle; {cls.__name__} loads '{cls.bundle_kind}' "
                "bundles" + (f": load it with {loader}" if loader else "")
            )
        if bundle.structure == "chunked_static":
            raise ValueError(
                f"{path} holds the static-shape functions of the iOS engine; "
                f"{cls.__name__} runs the function 'main' of the dynamic engines (run it with "
                "coreai_torch.bundles.StaticShapeEngine, or export with engine='dynamic')"
            )
        language = bundle.language
        saved = (
            read_coreai_config(path, check_assets=False) if (path / COREAI_CONFIG).is_file() else {}
        )
        if saved.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(
                f"{path} was written by a newer coreai-torch (format {saved['format_version']}, "
                f"this one reads up to {FORMAT_VERSION}); upgrade coreai-torch"
            )
        config = bundle_config(path, language)
        meta = {
            "format_version": FORMAT_VERSION,
            "task": cls.task,
            "class": cls.__name__,
            "model_type": config.model_type,
            "precision": saved.get("precision"),
            "compression": saved.get("compression", bundle.manifest.compression),
            **{k: v for k, v in saved.items() if k not in ("assets",)},
            "max_context": language.max_context_length,
            **cls._bundle_meta(bundle),
            "assets": {"model": str(Path(bundle.manifest.assets["main"]))},
        }
        generation = load_generation_config(path, config)
        if (
            not (path / "generation_config.json").is_file()  # Apple's bundles: the app's stops
            and generation.eos_token_id is None
            and bundle.tokenizer_dir is not None
        ):
            generation.eos_token_id = sorted(bundle.tokenizer.stop_token_ids) or None
        return cls(
            config,
            cls._bundle_assets(bundle),
            meta,
            generation_config=generation,
            source_dir=path,
            verify_hash=verify_hash,
        )

    def save_pretrained(
        self,
        save_directory: str | os.PathLike[str],
        *,
        tokenizer: Any = None,
        name: str | None = None,
        chat_template: str | None = None,
        **_: Any,
    ) -> None:
        """Write the bundle Apple's app runtimes load (``metadata.json``, ``tokenizer/``, the
        asset; :func:`coreai_torch.bundles.write_llm_bundle`) to ``save_directory``, with
        ``config.json``, ``generation_config.json`` and ``coreai_config.json`` beside it;
        :meth:`from_pretrained` loads it back without exporting.  ``tokenizer``: the
        tokenizer to embed (a Hugging Face tokenizer or its directory), by default the one of
        the directory the model was exported or loaded from; ``name`` the bundle's name
        (default: the directory's); ``chat_template`` replaces the tokenizer's.  A directory
        holding anything but a bundle is refused."""
        out = Path(save_directory)
        if out.exists() and not is_bundle_dir(out) and (not out.is_dir() or any(out.iterdir())):
            raise FileExistsError(
                f"{out} exists and is not a bundle; save_pretrained writes a bundle directory "
                "(and replaces an earlier one): choose a new or empty directory"
            )
        source = self._source_dir
        if tokenizer is None and source is not None:
            tokenizer = source / "tokenizer" if is_bundle_dir(source) else source
        if tokenizer is None:
            raise ValueError(
                "the bundle embeds the model's tokenizer: pass save_pretrained(..., "
                "tokenizer=tokenizer_or_its_directory)"
            )
        hf_dir = source if source is not None and not is_bundle_dir(source) else None
        meta = {k: v for k, v in self.coreai_config.items() if k != "assets"}
        meta["format_version"] = FORMAT_VERSION
        with tempfile.TemporaryDirectory(prefix="coreai_torch_save_") as scratch:
            files = {}
            self.config.save_pretrained(scratch)
            files["config.json"] = Path(scratch) / "config.json"
            if self.generation_config is not None:
                self.generation_config.save_pretrained(scratch)
                files["generation_config.json"] = Path(scratch) / "generation_config.json"
            (Path(scratch) / COREAI_CONFIG).write_text(
                json.dumps(meta, indent=2, sort_keys=True) + "\n"
            )
            files[COREAI_CONFIG] = Path(scratch) / COREAI_CONFIG
            self._write_bundle(
                out,
                files,
                model_dir=hf_dir,
                config=self.config,
                tokenizer=tokenizer,
                name=name,
                chat_template=chat_template,
                max_context_length=self.max_context,
                compression=self.coreai_config.get("compression"),
                overwrite=True,
            )

    @classmethod
    def _bundle_assets(cls, bundle: Any) -> dict[str, Path]:
        """The class's assets (by name) in a loaded bundle."""
        return {"model": bundle.asset_path("main")}

    @classmethod
    def _bundle_meta(cls, bundle: Any) -> dict[str, Any]:
        """What ``coreai_config`` takes from a loaded bundle beyond the language block."""
        return {}

    def _write_bundle(self, out: Path, files: dict[str, Path], **options: Any) -> None:
        """Write the bundle (``options``: :func:`~coreai_torch.bundles.write_llm_bundle`'s)."""
        from coreai_torch.bundles import write_llm_bundle

        write_llm_bundle(out, self.assets["model"], **options, files=files)

    # -- running main -------------------------------------------------------------------------

    @functools.cached_property
    def _main(self) -> Any:
        """The signature of the program's ``main`` (its inputs, logits and states)."""
        from coreai_torch.bundles import function_signatures
        from coreai_torch.llm.decoder import FUNCTION_NAME

        signatures = function_signatures(self.assets["model"])
        if FUNCTION_NAME not in signatures:
            raise ValueError(
                f"the program's functions are {sorted(signatures)}; {type(self).__name__} runs "
                f"'{FUNCTION_NAME}' (export the model again)"
            )
        return signatures[FUNCTION_NAME]

    def _new_cache(self, batch_size: int, positions: int = 0) -> RuntimeCache:
        from coreai_torch.llm.generate import new_states

        room = max(positions, 1)
        return RuntimeCache([new_states(self._main, room) for _ in range(batch_size)])

    def _returns_all_logits(self) -> bool:
        return True  # main returns the logits of every new token

    def _step(
        self, ids: Any, n: int, start: int, states: dict[str, Any], all_logits: bool
    ) -> np.ndarray:
        """One call of ``main``: ``n`` new tokens after ``start`` cached ones; the states grow
        first if they hold fewer than ``start + n`` positions.  Returns ``[n, vocab]``."""
        return self._call_main(np.asarray(ids, np.int32).reshape(1, n), start, states)

    def _call_main(self, first: np.ndarray, start: int, states: dict[str, Any]) -> np.ndarray:
        """``main`` with its first input ``first`` (``[1, n, ...]``: the new tokens' ids or
        embeddings) after ``start`` cached positions; the states grow first if they hold fewer
        than ``start + n``.  Returns the logits ``[n, vocab]``."""
        from coreai_torch.llm.generate import ensure_room

        function = self._main
        n = first.shape[1]
        ensure_room(states, function, start + n)
        first_name, positions_name = (spec.name for spec in function.inputs)
        out = self._run(
            self._decoder_asset,
            function.name,
            {first_name: first, positions_name: np.arange(start + n, dtype=np.int32)[None]},
            state=states,
        )
        return out[function.outputs[0].name][0].astype(np.float32)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: RuntimeCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast | tuple:
        """Feed ``input_ids`` (``[batch, tokens]``) after what ``past_key_values`` holds (a
        fresh cache if None); ``logits_to_keep=1`` returns only the last position's logits."""
        if inputs_embeds is not None:
            raise NotImplementedError(
                f"{type(self).__name__} takes input_ids, not inputs_embeds (the token "
                "embeddings are inside the Core AI program)"
            )
        if output_attentions or output_hidden_states:
            raise NotImplementedError(
                f"{type(self).__name__} returns logits only (no attentions or hidden states)"
            )
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                "input_ids must be a [batch, tokens] tensor of token ids with at least one token"
            )
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise NotImplementedError(
                f"logits_to_keep must be an int >= 0 here, got {logits_to_keep!r}"
            )
        cache = past_key_values if past_key_values is not None else self._new_cache(len(input_ids))
        if not isinstance(cache, RuntimeCache) or len(cache) != len(input_ids):
            raise ValueError(
                "past_key_values must be the RuntimeCache returned for the same batch size"
            )
        rows = split_rows(input_ids, attention_mask, cache.seen, cache.lengths)
        new = input_ids.shape[1]
        all_logits = logits_to_keep != 1
        logits = self._run_rows(cache, [(ids.numpy(), len(ids)) for _, ids in rows], all_logits)
        cache.seen += new
        vocab = logits[0].shape[-1]
        if all_logits:
            out = torch.zeros(len(rows), new, vocab, dtype=torch.float32)
            for r, ((cols, _), row) in enumerate(zip(rows, logits, strict=True)):
                out[r, cols] = torch.from_numpy(np.ascontiguousarray(row, np.float32))
            if logits_to_keep > 0:
                out = out[:, -logits_to_keep:]
        else:
            out = torch.from_numpy(np.stack([row[-1:] for row in logits]).astype(np.float32))
        result = CausalLMOutputWithPast(
            logits=out, past_key_values=cache if use_cache is not False else None
        )
        return result if return_dict is not False else result.to_tuple()


def bundle_config(path: Path, language: Any) -> Any:
    """The Hugging Face config of a bundle: its ``config.json``, else (Apple's bundles carry
    none) a plain ``PretrainedConfig`` with the vocabulary size and maximum context of its
    manifest."""
    from transformers import AutoConfig, PretrainedConfig

    if (path / "config.json").is_file():
        return AutoConfig.from_pretrained(path, local_files_only=True)
    return PretrainedConfig(
        vocab_size=language.vocab_size, max_position_embeddings=language.max_context_length
    )
