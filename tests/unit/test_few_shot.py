"""task.few_shot: worked examples as earlier chat turns before every prompt (backends/local/build.py
`_Tokenize`), and the config refusing them without a chat template."""

from __future__ import annotations

from typing import Any

import pytest

from relayrl.backends.local.build import _Tokenize
from relayrl.config.schema import Config, ConfigError, load_config


class _ChatTok:
    """A tokenizer stand-in whose chat template writes each turn as `<role>content|` (one id per
    character) and records the turns it was given."""

    model_max_length = 512

    def __init__(self) -> None:
        self.turns: list[dict[str, str]] = []

    def apply_chat_template(self, turns: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool) -> list[int]:
        self.turns = turns
        text = "".join(f"<{t['role']}>{t['content']}|" for t in turns) + ("<assistant>" if add_generation_prompt else "")
        return [ord(c) for c in text]


def test_examples_are_earlier_turns_with_the_question_through_the_template() -> None:
    tok = _ChatTok()
    encode = _Tokenize(tok, "{text} Only the number.", chat=True, few_shot=[("Calculate 12 + 7.", "19"), ("Calculate 3 * 14.", "42")])  # type: ignore[arg-type]
    ids = encode("Calculate 2 + 2.")
    assert tok.turns == [
        {"role": "user", "content": "Calculate 12 + 7. Only the number."},
        {"role": "assistant", "content": "19"},
        {"role": "user", "content": "Calculate 3 * 14. Only the number."},
        {"role": "assistant", "content": "42"},
        {"role": "user", "content": "Calculate 2 + 2. Only the number."},
    ]
    assert "".join(map(chr, ids)).endswith("<user>Calculate 2 + 2. Only the number.|<assistant>")
    plain = _ChatTok()
    _Tokenize(plain, "{text} Only the number.", chat=True)("Calculate 2 + 2.")  # type: ignore[arg-type]
    assert plain.turns == [{"role": "user", "content": "Calculate 2 + 2. Only the number."}]


def test_the_recipe_key_reaches_the_config_and_needs_the_chat_template() -> None:
    cfg: Any = load_config(None, ["model.chat_template=true", 'task.few_shot=[["Calculate 12 + 7.", "19"]]'])
    assert cfg.task.few_shot == [["Calculate 12 + 7.", "19"]]
    with pytest.raises((ConfigError, ValueError), match="task.few_shot needs model.chat_template"):
        Config.model_validate({"task": {"few_shot": [["Calculate 12 + 7.", "19"]]}})
    with pytest.raises((ConfigError, ValueError), match=r"example 0 has 1 entries: each is a \[question, answer\] pair"):
        Config.model_validate({"model": {"chat_template": True}, "task": {"few_shot": [["Calculate 12 + 7."]]}})
