"""Integer arithmetic prompts: a seeded, endless training stream and a fixed held-out set.

Job: turn an `ArithmeticConfig` (operand digits, operators, seeds) into `Prompt`s such as
text ``"23+9="`` with answer ``"32"``; the completion a policy should emit is exactly the answer
followed by EOS. The format is compact so that a character-level tokenizer handles it.

Invariants:
- Training prompt ``i`` is a pure function of (config, i): the stream is deterministic given the
  seed, can be resumed from any cursor, and ``prompt_id`` is ``"arith-train-<i>"``.
- A stable hash of the problem text reserves a share of the problem space for evaluation: the
  training stream never yields a reserved problem, and ``heldout(n)`` only yields reserved ones
  (distinct, drawn with ``heldout_seed``). So train and held-out are disjoint by construction and
  ``heldout(n)`` is a prefix of ``heldout(m)`` for n ≤ m.
- Every answer is the exact integer result written in base 10 (``"-7"`` for negatives).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from relayrl.errors import UserError
from relayrl.types import Prompt

OPERATORS: tuple[str, ...] = ("+", "-", "*")
_HASH_BUCKETS = 10_000


@dataclass(slots=True, frozen=True)
class ArithmeticConfig:
    """Settings of the arithmetic task.

    Operands are drawn uniformly from ``[0, 10**max_digits - 1]``. With ``allow_negative`` off,
    subtraction swaps its operands so that the result is never negative.
    """

    max_digits: int = 2
    operators: tuple[str, ...] = ("+", "-")
    allow_negative: bool = False
    seed: int = 0
    heldout_seed: int = 1_000_003
    heldout_share: float = 0.1  # share of the problem space reserved for held-out prompts
    id_prefix: str = "arith"

    def __post_init__(self) -> None:
        if not isinstance(self.max_digits, int) or not 1 <= self.max_digits <= 9:
            raise UserError(f"arithmetic.max_digits must be an int in 1..9, got {self.max_digits!r}")
        ops = tuple(self.operators)
        if not ops:
            raise UserError("arithmetic.operators must name at least one of '+', '-', '*'")
        bad = [op for op in ops if op not in OPERATORS]
        if bad:
            raise UserError(f"arithmetic.operators: unknown operator(s) {bad!r}; allowed: {OPERATORS!r}")
        if len(set(ops)) != len(ops):
            raise UserError(f"arithmetic.operators has duplicates: {ops!r}")
        if not 0.0 < self.heldout_share < 1.0:
            raise UserError(f"arithmetic.heldout_share must lie in (0, 1), got {self.heldout_share!r}")
        if self.seed == self.heldout_seed:
            raise UserError("arithmetic.seed and arithmetic.heldout_seed must differ")
        object.__setattr__(self, "operators", ops)


def evaluate(a: int, op: str, b: int) -> int:
    """The exact integer result of ``a op b``."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}")


class ArithmeticTask:
    """Source of arithmetic prompts: ``stream()`` for training, ``heldout(n)`` for evaluation."""

    __slots__ = ("config", "_reserved_below")

    def __init__(self, config: ArithmeticConfig | None = None) -> None:
        self.config: ArithmeticConfig = config if config is not None else ArithmeticConfig()
        self._reserved_below: int = max(1, round(self.config.heldout_share * _HASH_BUCKETS))

    # -- problem space ---------------------------------------------------------------------------
    def is_reserved(self, text: str) -> bool:
        """Whether the problem with this prompt text belongs to the held-out share."""
        return zlib.crc32(text.encode()) % _HASH_BUCKETS < self._reserved_below

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        cfg = self.config
        hi = 10**cfg.max_digits - 1
        op = rng.choice(cfg.operators)
        a = rng.randint(0, hi)
        b = rng.randint(0, hi)
        if op == "-" and not cfg.allow_negative and a < b:
            a, b = b, a
        return f"{a}{op}{b}=", str(evaluate(a, op, b))

    def max_answer_chars(self) -> int:
        """Length of the longest possible answer text (so ``max_new_tokens`` = this + 1 for EOS)."""
        cfg = self.config
        hi = 10**cfg.max_digits - 1
        longest = 0
        for op in cfg.operators:
            if op == "-" and cfg.allow_negative:
                longest = max(longest, len(str(-hi)))
            else:
                longest = max(longest, len(str(evaluate(hi, op, hi))), len(str(evaluate(hi, op, 0))))
        return longest

    # -- training stream -------------------------------------------------------------------------
    def train_prompt(self, index: int) -> Prompt:
        """Training prompt number ``index`` (random access: resuming needs only the cursor)."""
        if index < 0:
            raise ValueError(f"training prompt index must be >= 0, got {index}")
        rng = random.Random(f"{self.config.id_prefix}:train:{self.config.seed}:{index}")
        for _ in range(10_000):
            text, answer = self._draw(rng)
            if not self.is_reserved(text):
                return Prompt(prompt_id=f"{self.config.id_prefix}-train-{index}", text=text, answer=answer)
        raise RuntimeError("arithmetic: could not draw a non-reserved problem; heldout_share too large")

    def stream(self, start: int = 0) -> Iterator[Prompt]:
        """Endless training prompts ``start, start+1, ...``; deterministic given the seed."""
        index = start
        while True:
            yield self.train_prompt(index)
            index += 1

    # -- held-out set ----------------------------------------------------------------------------
    def heldout(self, n: int) -> list[Prompt]:
        """The first ``n`` prompts of the fixed held-out set: distinct problems, none of which the
        training stream ever yields. Raises ``ValueError`` if the reserved share has fewer than
        ``n`` distinct problems within a generous number of draws."""
        if n < 0:
            raise ValueError(f"heldout size must be >= 0, got {n}")
        rng = random.Random(f"{self.config.id_prefix}:heldout:{self.config.heldout_seed}")
        seen: set[str] = set()
        out: list[Prompt] = []
        budget = 2_000 * n + 100_000
        while len(out) < n and budget > 0:
            budget -= 1
            text, answer = self._draw(rng)
            if text in seen or not self.is_reserved(text):
                continue
            seen.add(text)
            out.append(Prompt(prompt_id=f"{self.config.id_prefix}-heldout-{len(out)}", text=text, answer=answer))
        if len(out) < n:
            raise UserError(
                f"arithmetic: only {len(out)} distinct held-out problems found, {n} requested; "
                "raise max_digits, add operators or raise heldout_share"
            )
        return out
