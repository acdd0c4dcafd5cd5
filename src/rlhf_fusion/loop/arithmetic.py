"""A task with a checkable answer for the critic-free demo: small arithmetic, scored by
correctness.

Prompts are ``"a+b="`` and ``"a-b="`` over single digits whose answer is one digit (0..9); the
reward is whether the number the completion starts with is the answer. A random tiny model
hits it about once in 17 samples (one token of its vocabulary is the right digit), so a group
of 8 samples usually holds a correct one and GRPO has a signal from the first iteration; the
vocabulary is only what the task needs (:class:`ArithmeticTokenizer`: digits, ``+ - =`` and a
space), so nothing is downloaded.

The reward functions have TRL's signature (``f(prompts, completions, completion_ids,
**kwargs) -> list[float]``) and are named in a config by import path::

    models:
      tokenizer: arithmetic
      reward:
        functions:
          - {function: "rlhf_fusion.loop.arithmetic:correctness_reward", weight: 1.0}
          - {function: "rlhf_fusion.loop.arithmetic:format_reward", weight: 0.1}

``models.reward: arithmetic`` is the correctness rule alone.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from .tokenizers import ArithmeticTokenizer  # the task's tokenizer, named with it

__all__ = [
    "ArithmeticTokenizer",
    "answer_of",
    "arithmetic_prompts",
    "correct",
    "correctness_reward",
    "format_reward",
    "leading_number",
]

_PROMPT = re.compile(r"^\s*(\d+)\s*([+\-])\s*(\d+)\s*=\s*$")
_LEADING = re.compile(r"^\s*(-?\d+)")


def arithmetic_prompts(*, largest: int = 9) -> list[str]:
    """Every ``a+b=`` and ``a-b=`` with ``a, b`` digits and the answer in ``0..largest``, in a
    fixed shuffled order (seed 0), so a run's batches mix both operators."""
    out = [f"{a}+{b}=" for a in range(10) for b in range(10) if a + b <= largest]
    out += [f"{a}-{b}=" for a in range(10) for b in range(10) if 0 <= a - b <= largest]
    random.Random(0).shuffle(out)
    return out


def answer_of(prompt: str) -> int:
    """The answer of ``"a+b="`` / ``"a-b="``; ValueError for anything else."""
    m = _PROMPT.match(prompt)
    if m is None:
        raise ValueError(f"not an arithmetic prompt (a+b= or a-b=): {prompt!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b


def leading_number(completion: str) -> int | None:
    """The integer the completion starts with (spaces before it allowed), else None."""
    m = _LEADING.match(completion)
    return int(m.group(1)) if m else None


def correct(prompt: str, completion: str) -> float:
    """1.0 when the completion starts with the answer (``"7"``, ``" 7"``, ``"7 + 1"``; not
    ``"72"``), else 0.0: the text-only rule (``models.reward: arithmetic``)."""
    return float(leading_number(completion) == answer_of(prompt))


def correctness_reward(prompts: Sequence[str], completions: Sequence[str],
                       completion_ids: Sequence[Sequence[int]] | None = None,
                       **kwargs: Any) -> list[float]:
    """TRL-signature correctness: :func:`correct` per completion."""
    return [correct(p, c) for p, c in zip(prompts, completions, strict=True)]


def format_reward(prompts: Sequence[str], completions: Sequence[str],
                  completion_ids: Sequence[Sequence[int]] | None = None,
                  **kwargs: Any) -> list[float]:
    """TRL-signature format reward: 1.0 for a bare number (digits only, at most 2), else 0.0;
    it reads the token ids (the completion's length) as TRL passes them."""
    ids = completion_ids if completion_ids is not None else [[]] * len(completions)
    return [float(bool(re.fullmatch(r"\d{1,2}", c)) and (not i or len(i) <= 3))
            for c, i in zip(completions, ids, strict=True)]
