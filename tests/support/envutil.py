"""Helpers for tests of multi-turn episodes: an observation encoder that records its calls."""

from __future__ import annotations

import threading


class CharEncoder:
    """A `TextEncoder`: one token (3) per character; records the length of each text it encoded
    and the thread it ran on."""

    max_token_chars = 1

    def __init__(self) -> None:
        self.lengths: list[int] = []
        self.threads: list[str] = []
        self.special: list[bool] = []

    def __call__(self, text: str, *, special_tokens: bool = False) -> list[int]:
        self.lengths.append(len(text))
        self.threads.append(threading.current_thread().name)
        self.special.append(special_tokens)
        return [3] * len(text)
