"""The ``tokenizer/`` directory: the swift-transformers registry and the app's stop-token
rules (``LanguageConfig.additionalStopTokenIds``), checked on tokenizers built offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coreai_torch.bundles import BundleError, read_tokenizer, write_tokenizer
from coreai_torch.bundles.tokenizer import stop_token_ids, turn_terminator
from tests.bundles.support import make_tokenizer

#: style -> (the turn terminator its template emits, the eos_token the bundle names)
EXPECTED = {
    "llama3": ("<|eot_id|>", "<|eot_id|>"),
    "qwen": ("<|im_end|>", "<|im_end|>"),
    "gemma": ("<end_of_turn>", "<end_of_turn>"),
    "mistral": ("</s>", "</s>"),  # the template emits eos_token itself
    "base": (None, "</s>"),  # no chat template
}


@pytest.mark.parametrize("style", sorted(EXPECTED))
def test_the_app_stops_on_the_turn_terminator_and_every_eos(tmp_path: Path, style: str) -> None:
    tokenizer = make_tokenizer(style)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    info = write_tokenizer(tmp_path / "tokenizer", tokenizer, eos_token_ids=[eos])
    terminator, eos_token = EXPECTED[style]
    assert turn_terminator(info) == terminator
    assert info.eos_token == eos_token
    assert eos in info.stop_token_ids  # the source's eos still stops the app
    if terminator is not None:
        assert info.token_id(terminator) in info.stop_token_ids
        assert info.chat_template and (tmp_path / "tokenizer" / "chat_template.jinja").is_file()
    # read back with the same rules, and by transformers (the Python side still loads it)
    assert read_tokenizer(tmp_path / "tokenizer") == info
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    text = "the quick brown fox"
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_an_eos_only_in_generation_config_becomes_a_stop_token(tmp_path: Path) -> None:
    tokenizer = make_tokenizer("llama3")
    header = tokenizer.convert_tokens_to_ids("<|start_header_id|>")  # not a terminator name
    info = write_tokenizer(tmp_path / "t", tokenizer, eos_token_ids=[header])
    config = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    assert "<|start_header_id|>" in config["additional_special_tokens"]
    assert header in info.stop_token_ids


def test_eos_ids_outside_the_vocabulary_are_refused(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"end-of-sequence ids \[5000\] are not tokens"):
        write_tokenizer(tmp_path / "t", make_tokenizer("qwen"), eos_token_ids=[5000])


def test_the_stop_rules_of_the_app() -> None:
    vocab = {"<eos>": 1, "<a>": 2, "<b>": 3, "<end_of_turn>": 4, "<x_eot_id>": 5, "<plain>": 6}
    config = {
        "eos_token": {"content": "<eos>"},
        "additional_special_tokens": ["<a>", {"content": "<b>"}, "<missing>"],
        "added_tokens_decoder": {
            "4": {"content": "<end_of_turn>", "special": True},
            "5": {"content": "<x_eot_id>", "special": False},  # not special: not a stop
            "6": {"content": "<plain>", "special": True},  # no terminator name
        },
    }
    assert stop_token_ids(config, vocab) == {1, 2, 3, 4}
    assert stop_token_ids({"eos_token": ["<eos>", "<plain>"]}, vocab) == {6, 1}
    assert stop_token_ids({"im_end": "<plain>"}, vocab) == {6}


def test_classes_outside_the_swift_registry_are_mapped(tmp_path: Path) -> None:
    tokenizer = make_tokenizer("qwen")
    tokenizer.save_pretrained(tmp_path / "src")
    config_path = tmp_path / "src" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "MyCustomTokenizerFast"
    config_path.write_text(json.dumps(config))
    info = write_tokenizer(tmp_path / "t", tmp_path / "src")
    assert info.tokenizer_class == "PreTrainedTokenizer"  # reads the BPE from tokenizer.json
    config["tokenizer_class"] = "Qwen2TokenizerFast"  # registered ("Fast" stripped): kept
    config_path.write_text(json.dumps(config))
    assert (
        write_tokenizer(tmp_path / "t2", tmp_path / "src").tokenizer_class == "Qwen2TokenizerFast"
    )


def test_unigram_tokenizer_of_an_unknown_class_is_refused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    source = tmp_path / "src"
    source.mkdir()
    Tokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0), ("b", -2.0)], 0)).save(
        str(source / "tokenizer.json")
    )
    (source / "tokenizer_config.json").write_text('{"tokenizer_class": "SentencePieceThing"}')
    with pytest.raises(
        BundleError, match="Unigram model is not in the swift-transformers registry"
    ):
        write_tokenizer(tmp_path / "t", source)


def test_read_errors_name_the_file_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"tokenizer.json is missing.*configurationMissing"):
        read_tokenizer(tmp_path)
    make_tokenizer("qwen").save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["tokenizer_class"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(BundleError, match=r"no tokenizer_class.*missingTokenizerClassInConfig"):
        read_tokenizer(tmp_path)
    config["tokenizer_class"] = "SentencePieceThing"
    config_path.write_text(json.dumps(config))
    with pytest.raises(BundleError, match="'SentencePieceThing' is not in the swift-transformers"):
        read_tokenizer(tmp_path)


def test_a_slow_only_tokenizer_directory_is_converted_or_refused(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "tokenizer_config.json").write_text('{"tokenizer_class": "GPT2Tokenizer"}')
    with pytest.raises(BundleError, match=r"has no tokenizer\.json"):
        write_tokenizer(tmp_path / "t", source)
