"""``coreai-torch llm generate --chat`` formats the prompt with the model's chat template, and
``--interactive`` keeps the conversation: each reply is generated from every turn so far."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from coreai_torch.cli.main import main
from coreai_torch.llm.generate import Generator, decode
from tests.serve.support import save_model

pytestmark = pytest.mark.xdist_group("llm_cli_chat")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    asset, hf = save_model(tmp_path_factory.mktemp("chat"))
    generator = Generator(asset, tokenizer=hf)
    yield {"asset": asset, "hf": hf, "generator": generator}
    generator.close()


def reply(model: dict[str, Any], messages: list[dict[str, str]], n: int) -> str:
    tokenizer = model["generator"].tokenizer
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    tokens = list(model["generator"].generate(list(ids), max_new_tokens=n))
    return decode(tokenizer, [t for t in tokens if t != tokenizer.eos_token_id])


def args(model: dict[str, Any], *extra: str) -> list[str]:
    asset, hf = str(model["asset"]), str(model["hf"])
    return ["llm", "generate", asset, "--tokenizer", hf, "--max-new-tokens", "6", *extra]


def test_chat_applies_the_chat_template(model: dict[str, Any], capsys: Any) -> None:
    assert main(args(model, "--chat", "--system", "be brief", "--prompt", "the quick")) == 0
    text = capsys.readouterr().out.splitlines()[0]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick"}]
    assert text == reply(model, messages, 6)


def test_interactive_keeps_the_conversation(
    model: dict[str, Any], capsys: Any, monkeypatch: Any
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("brown fox\n\n"))
    assert main(args(model, "--interactive", "--prompt", "the quick")) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    turns = [{"role": "user", "content": "the quick"}]
    assert first == reply(model, turns, 6)
    turns += [{"role": "assistant", "content": first}, {"role": "user", "content": "brown fox"}]
    assert second == reply(model, turns, 6)


def test_chat_without_a_template_is_a_clear_error(tmp_path: Path, capsys: Any) -> None:
    from tests.llm.support import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path)
    from coreai_torch.llm.generate import load_tokenizer
    from coreai_torch.llm.text import chat_ids

    with pytest.raises(ValueError, match="no chat template"):
        chat_ids(load_tokenizer(tmp_path), [{"role": "user", "content": "hi"}])
    asset = str(tmp_path / "m.aimodel")
    assert main(["llm", "generate", asset, "--tokenizer", str(tmp_path), "--chat"]) == 2
    assert "--prompt is needed" in capsys.readouterr().err
