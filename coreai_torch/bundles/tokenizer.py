"""The bundle's ``tokenizer/`` directory, as the app reads it.

The app loads it with swift-transformers (1.2.0, pinned by Apple's package) and stops a
generation on a set of tokens computed from ``tokenizer_config.json`` alone
(``COREAI_BUNDLES.md`` §4):

* ``tokenizer.json`` must exist; ``tokenizer_config.json`` must name a ``tokenizer_class`` that
  the swift-transformers registry knows (a ``Fast`` suffix is stripped first);
* the chat template comes from ``chat_template.jinja``, else ``chat_template.json``, else the
  ``chat_template`` key of ``tokenizer_config.json``;
* the stop set is the id of ``eos_token`` plus ``LanguageConfig.additionalStopTokenIds``: every
  entry of ``additional_special_tokens`` the tokenizer knows, every string of an array-valued
  ``eos_token``, every special ``added_tokens_decoder`` entry whose content holds
  ``end_of_turn``/``im_end``/``eot_id``/``endoftext``/``eot_token``, and the top-level keys of
  those names.  ``generation_config.json`` is not read.

:func:`read_tokenizer` applies these rules (``TokenizerInfo.stop_token_ids`` is the set the
app stops on); :func:`write_tokenizer` writes a directory that passes them and makes the app
stop where the model's own generation stops: on the ids its configs name as end of sequence
and on the token its chat template closes an assistant turn with.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coreai_torch.errors import BundleError, BundleNotFoundError

#: ``TokenizerModel.knownTokenizers`` of swift-transformers 1.2.0
SWIFT_TOKENIZER_CLASSES = frozenset(
    {
        "BertTokenizer",
        "CodeGenTokenizer",
        "CodeLlamaTokenizer",
        "CohereTokenizer",
        "DistilbertTokenizer",
        "DistilBertTokenizer",
        "FalconTokenizer",
        "GemmaTokenizer",
        "GPT2Tokenizer",
        "LlamaTokenizer",
        "RobertaTokenizer",
        "T5Tokenizer",
        "TokenizersBackend",
        "PreTrainedTokenizer",
        "Qwen2Tokenizer",
        "WhisperTokenizer",
        "XLMRobertaTokenizer",
        "Xlm-RobertaTokenizer",
    }
)
#: the class written for a tokenizer whose own class the registry lacks, by model type
#: (``tokenizer.json`` ``model.type``): both read the model from ``tokenizer.json``
_CLASS_FOR_MODEL = {"BPE": "PreTrainedTokenizer", "WordPiece": "BertTokenizer"}
#: substrings of special tokens that ``additionalStopTokenIds`` treats as turn terminators
TURN_END_PATTERNS = ("end_of_turn", "im_end", "eot_id", "endoftext", "eot_token")
#: the files copied from a model directory
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer directory as the app reads it."""

    directory: Path
    #: ``tokenizer_config.json``'s class, as written
    tokenizer_class: str
    #: ``tokenizer.json``'s ``model.type`` (``BPE``, ``Unigram``, ``WordPiece``, ...)
    model_type: str
    eos_token: str | None
    eos_token_id: int | None
    #: the tokens a generation stops on in the app (the eos id and the additional stop ids)
    stop_token_ids: frozenset[int]
    chat_template: str | None
    #: token -> id (the model's vocabulary and the added tokens)
    vocab: Mapping[str, int] = field(repr=False)
    #: the added tokens marked special
    special_tokens: frozenset[str] = field(repr=False)

    def token_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def token(self, token_id: int) -> str | None:
        return next((t for t, i in self.vocab.items() if i == token_id), None)


# ------------------------------------------------------------------------------- reading ---


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        raise BundleError(f"{path} is not valid JSON ({error})") from error


def _text(value: Any) -> str | None:
    """A token given as a string or an AddedToken object (``{"content": ...}``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        content = value.get("content")
        if isinstance(content, str):
            return content
    return None


def _vocab(data: dict[str, Any]) -> tuple[str, dict[str, int], frozenset[str]]:
    model = data.get("model") or {}
    model_type = str(model.get("type") or "")
    raw = model.get("vocab")
    vocab: dict[str, int] = {}
    if isinstance(raw, dict):
        vocab = {str(k): int(v) for k, v in raw.items()}
    elif isinstance(raw, list):  # Unigram: [[piece, score], ...], ids by position
        vocab = {str(entry[0]): i for i, entry in enumerate(raw)}
    special = set()
    for token in data.get("added_tokens") or []:
        if isinstance(token.get("content"), str) and isinstance(token.get("id"), int):
            vocab[token["content"]] = token["id"]
            if token.get("special"):
                special.add(token["content"])
    return model_type, vocab, frozenset(special)


def chat_template_of(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The chat template swift-transformers uses: ``chat_template.jinja``, else
    ``chat_template.json``, else the ``chat_template`` key (named templates joined)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    as_json = directory / "chat_template.json"
    template: Any = None
    if as_json.is_file():
        template = _load_json(as_json).get("chat_template")
    if template is None:
        template = config.get("chat_template")
    if isinstance(template, list):
        template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) and template else None


def stop_token_ids(config: Mapping[str, Any], vocab: Mapping[str, int]) -> frozenset[int]:
    """The tokens a generation stops on in the app: ``eos_token``'s id and
    ``LanguageConfig.additionalStopTokenIds`` (see the module docstring)."""
    ids: set[int] = set()
    eos = _text(config.get("eos_token"))
    if eos is not None and eos in vocab:
        ids.add(vocab[eos])
    for item in config.get("additional_special_tokens") or []:
        token = _text(item)
        if token is not None and token in vocab:
            ids.add(vocab[token])
    if isinstance(config.get("eos_token"), list):
        ids.update(vocab[t] for t in config["eos_token"] if isinstance(t, str) and t in vocab)
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else None
        if (
            isinstance(entry, dict)
            and entry.get("special") is True
            and isinstance(content, str)
            and str(key).lstrip("-").isdigit()
            and any(p in content.lower() for p in TURN_END_PATTERNS)
        ):
            ids.add(int(key))
    for pattern in TURN_END_PATTERNS:
        token = config.get(pattern)
        if isinstance(token, str) and token in vocab:
            ids.add(vocab[token])
    return frozenset(ids)


def read_tokenizer(directory: str | os.PathLike[str]) -> TokenizerInfo:
    """Read a bundle's tokenizer directory with the app's rules; raises
    :class:`~coreai_torch.errors.BundleError` where swift-transformers would fail."""
    directory = Path(directory)
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise BundleNotFoundError(
            f"{tokenizer_json} is missing; swift-transformers loads the tokenizer from it "
            "(configurationMissing): save a fast tokenizer (tokenizer.json) into the bundle"
        )
    model_type, vocab, special = _vocab(_load_json(tokenizer_json))
    config_path = directory / "tokenizer_config.json"
    config = _load_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise BundleError(f"{config_path} must hold a JSON object")
    tokenizer_class = config.get("tokenizer_class")
    if not isinstance(tokenizer_class, str) or not tokenizer_class:
        raise BundleError(
            f"{config_path} has no tokenizer_class; swift-transformers refuses the tokenizer "
            "(missingTokenizerClassInConfig): write one of "
            f"{sorted(SWIFT_TOKENIZER_CLASSES)}"
        )
    if tokenizer_class.replace("Fast", "") not in SWIFT_TOKENIZER_CLASSES:
        raise BundleError(
            f"{config_path}: tokenizer_class {tokenizer_class!r} is not in the swift-transformers "
            f"registry (unsupportedTokenizer); it knows {sorted(SWIFT_TOKENIZER_CLASSES)}. "
            "Write the tokenizer with coreai_torch.bundles.write_tokenizer, which maps it to a "
            "registered class of the same algorithm"
        )
    eos = _text(config.get("eos_token"))
    return TokenizerInfo(
        directory=directory,
        tokenizer_class=tokenizer_class,
        model_type=model_type,
        eos_token=eos,
        eos_token_id=vocab.get(eos) if eos is not None else None,
        stop_token_ids=stop_token_ids(config, vocab),
        chat_template=chat_template_of(directory, config),
        vocab=vocab,
        special_tokens=special,
    )


# ------------------------------------------------------------------------------- writing ---


def swift_tokenizer_class(tokenizer_class: str | None, model_type: str, *, where: str) -> str:
    """The ``tokenizer_class`` to write: the tokenizer's own when the registry knows it, else
    a registered class that reads the same algorithm from ``tokenizer.json`` (BPE:
    ``PreTrainedTokenizer``, WordPiece: ``BertTokenizer``); refuses what has none."""
    if tokenizer_class and tokenizer_class.replace("Fast", "") in SWIFT_TOKENIZER_CLASSES:
        return tokenizer_class
    if model_type in _CLASS_FOR_MODEL:
        return _CLASS_FOR_MODEL[model_type]
    raise BundleError(
        f"{where}: tokenizer_class {tokenizer_class!r} with a {model_type or 'unknown'} model "
        "is not in the swift-transformers registry, and no registered class reads that model "
        "without changing its special tokens (Unigram models are read only as T5Tokenizer or "
        "XLMRobertaTokenizer): tag the source tokenizer with one of "
        f"{sorted(SWIFT_TOKENIZER_CLASSES)} if it is one of them"
    )


def write_tokenizer(
    directory: str | os.PathLike[str],
    tokenizer: Any,
    *,
    eos_token_ids: Iterable[int] = (),
    chat_template: str | None = None,
) -> TokenizerInfo:
    """Write the tokenizer directory of a bundle into ``directory`` (created; must not exist).

    ``tokenizer`` is a Hugging Face tokenizer (``save_pretrained`` is used) or a directory
    holding its files (a model directory: only the tokenizer files are copied; a directory
    without ``tokenizer.json`` is converted with ``transformers.AutoTokenizer``).
    ``eos_token_ids``: the ids the model's generation stops on (``generation_config.json``'s
    and ``config.json``'s ``eos_token_id``); ``chat_template`` replaces the tokenizer's.

    The class is mapped to one the app knows (:func:`swift_tokenizer_class`), and the stop
    tokens are resolved so that the app stops on every id of ``eos_token_ids``, on the
    tokenizer's ``eos_token`` and on the token the chat template ends an assistant turn with:
    when the template does not emit ``eos_token`` but ends turns with a special token, that
    token becomes ``eos_token``; every id still missing is added to
    ``additional_special_tokens``.  Raises :class:`~coreai_torch.errors.BundleError` for a
    tokenizer the app cannot load or stop."""
    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} exists; write_tokenizer creates it")
    _save(tokenizer, directory)
    if chat_template is not None:
        for stale in ("chat_template.json",):
            (directory / stale).unlink(missing_ok=True)
        (directory / "chat_template.jinja").write_text(chat_template)
    config_path = directory / "tokenizer_config.json"
    config = _load_json(config_path) if config_path.is_file() else {}
    if chat_template is not None:
        config.pop("chat_template", None)
    model_type, vocab, _ = _vocab(_load_json(directory / "tokenizer.json"))
    config["tokenizer_class"] = swift_tokenizer_class(
        config.get("tokenizer_class"), model_type, where=str(config_path)
    )
    _write_json(config_path, config)
    info = read_tokenizer(directory)
    wanted = {int(i) for i in eos_token_ids}
    if info.eos_token_id is not None:
        wanted.add(info.eos_token_id)
    terminator = turn_terminator(info)
    if terminator is not None:
        wanted.add(vocab[terminator])
        if not _template_emits_eos(info):
            config["eos_token"] = terminator
    missing = sorted(wanted - stop_token_ids(config, vocab))
    if missing:
        by_id = {i: t for t, i in vocab.items()}
        unknown = [i for i in missing if i not in by_id]
        if unknown:
            raise BundleError(
                f"{directory}: the end-of-sequence ids {unknown} are not tokens of the tokenizer "
                f"(its ids run to {max(vocab.values(), default=-1)}); the app could never stop "
                "on them: check eos_token_id in the model's config and generation_config"
            )
        extra = list(config.get("additional_special_tokens") or [])
        extra += [by_id[i] for i in missing]
        config["additional_special_tokens"] = extra
    _write_json(config_path, config)
    info = read_tokenizer(directory)
    if not wanted <= info.stop_token_ids:  # the rules above guarantee it; kept as a check
        raise BundleError(
            f"{directory}: stop tokens {sorted(wanted - info.stop_token_ids)} unresolved"
        )
    return info


def _save(tokenizer: Any, directory: Path) -> None:
    if hasattr(tokenizer, "save_pretrained"):
        with tempfile.TemporaryDirectory(prefix="coreai_torch_tokenizer_") as tmp:
            tokenizer.save_pretrained(tmp)
            _copy_files(Path(tmp), directory)
        if not (directory / "tokenizer.json").is_file():
            raise BundleError(
                f"{type(tokenizer).__name__} saves no tokenizer.json, which the app's tokenizer "
                "reads: pass the fast tokenizer (transformers' *TokenizerFast, "
                "AutoTokenizer.from_pretrained(..., use_fast=True))"
            )
        return
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(
            "tokenizer must be a Hugging Face tokenizer or the directory of its files, got "
            f"{type(tokenizer).__name__}"
        )
    source = Path(tokenizer)
    if not source.is_dir():
        raise BundleNotFoundError(f"tokenizer directory {source} does not exist")
    if (source / "tokenizer.json").is_file():
        _copy_files(source, directory)
        return
    try:
        from transformers import AutoTokenizer

        loaded = AutoTokenizer.from_pretrained(source, use_fast=True)
    except Exception as error:
        raise BundleError(
            f"{source} has no tokenizer.json (the app's tokenizer reads it) and transformers "
            f"cannot build one from its files ({error})"
        ) from error
    _save(loaded, directory)


def _copy_files(source: Path, directory: Path) -> None:
    directory.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# -------------------------------------------------------------- the template's terminator ---


def _template_emits_eos(info: TokenizerInfo) -> bool:
    """Whether the chat template emits ``eos_token`` (literally or as the variable)."""
    import re

    template = info.chat_template or ""
    if info.eos_token and info.eos_token in template:
        return True
    literals = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")
    return re.search(r"\beos_token\b", literals.sub("", template)) is not None


def turn_terminator(info: TokenizerInfo) -> str | None:
    """The special token the chat template closes an assistant turn with (``<|im_end|>``,
    ``<end_of_turn>``, ``<|eot_id|>``, ``</s>``, ...), or ``None`` (no template, or turns end
    without a special token).  Found by rendering a user/assistant exchange with the
    template (transformers' ``apply_chat_template``), else by the terminator names the app
    knows."""
    if not info.chat_template:
        return None
    marker = "COREAI_TORCH_ASSISTANT_TURN"
    exchange = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": marker}]
    rendered = render_chat(info.directory, exchange)
    specials = sorted(info.special_tokens | {info.eos_token or ""} - {""}, key=len, reverse=True)
    if rendered is not None and marker in rendered:
        after = rendered.split(marker, 1)[1].lstrip(" ")
        for token in specials:
            if after.startswith(token):
                return token
        return None
    for pattern in TURN_END_PATTERNS:
        for token in specials:
            if pattern in token.lower() and token in info.chat_template:
                return token
    return None


def render_chat(
    directory: Path, messages: list[dict[str, Any]], *, add_generation_prompt: bool = False
) -> str | None:
    """``messages`` rendered with the directory's chat template as transformers'
    ``apply_chat_template`` renders them (jinja2 sandbox, ``trim_blocks``, ``lstrip_blocks``,
    ``loopcontrols``, ``raise_exception``, ``strftime_now``, the special tokens as
    variables); None without a template (or jinja2), or for a template that rejects them."""
    try:
        import datetime

        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return None
    config_path = directory / "tokenizer_config.json"
    config = _load_json(config_path) if config_path.is_file() else {}
    template = chat_template_of(directory, config)
    if template is None:
        return None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    tokens = {
        key: _text(value)
        for key, value in config.items()
        if key.endswith("_token") and _text(value) is not None
    }
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **tokens
        )
    except jinja2.exceptions.TemplateError:  # a template that rejects this exchange
        return None
