"""Reward functions named in the config by import path, called as TRL calls its own.

``models.reward`` may name Python functions instead of a reward model::

    models:
      reward: {function: "my_pkg.rewards:math_reward"}
    # or several, weighted (TRL's reward_funcs + reward_weights):
      reward:
        functions:
          - {function: "my_pkg.rewards:math_reward", weight: 1.0}
          - {function: "my_pkg.rewards:format_reward", weight: 0.2}

Each function is called as TRL's ``GRPOTrainer`` calls a reward function:
``f(prompts=[...], completions=[...], completion_ids=[[...]], **kwargs) -> list[float | None]``
(the completion's token ids beside its text). The loop scores each sample as it finishes (so
scoring streams during the rollout's tail), so the lists hold one sample; a ``None`` is TRL's
"not applicable" and counts as 0 in the weighted sum (TRL's ``nansum``). A reference is
resolved and its signature checked by :func:`resolve_reward_spec` when the config is
validated, before any rank starts; every error names the field
(``models.reward.functions[1].function``).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import LoopConfigError

__all__ = ["RewardFunctions", "is_function_spec", "resolve_reward_spec"]

_TRL_ARGS = ("prompts", "completions", "completion_ids")


def is_function_spec(value: Any) -> bool:
    """``models.reward`` names functions (``function:`` or ``functions:``), not a model."""
    return isinstance(value, Mapping) and ("function" in value or "functions" in value)


@dataclass(frozen=True)
class _Entry:
    ref: str
    fn: Callable[..., Sequence[float | None]]
    weight: float


class RewardFunctions:
    """The weighted sum of TRL-style reward functions; one per ``functions:`` entry."""

    def __init__(self, entries: Sequence[_Entry]) -> None:
        self.entries = tuple(entries)

    @property
    def names(self) -> list[str]:
        return [e.ref for e in self.entries]

    def per_function(self, prompts: Sequence[str], completions: Sequence[str],
                     completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """``[function][sample]`` raw values, ``nan`` for a ``None`` (TRL's convention)."""
        out = []
        for e in self.entries:
            vals = e.fn(prompts=list(prompts), completions=list(completions),
                        completion_ids=[list(map(int, c)) for c in completion_ids])
            vals = list(vals)
            if len(vals) != len(prompts):
                raise ValueError(f"reward function {e.ref} returned {len(vals)} rewards for "
                                 f"{len(prompts)} completions; return one per completion")
            out.append([math.nan if v is None else float(v) for v in vals])
        return out

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str],
                    completion_ids: Sequence[Sequence[int]]) -> list[float]:
        """Per sample, ``sum_i weight_i * f_i`` over the functions that gave a value."""
        raw = self.per_function(prompts, completions, completion_ids)
        return [sum(e.weight * r[j] for e, r in zip(self.entries, raw, strict=True)
                    if not math.isnan(r[j]))
                for j in range(len(prompts))]

    def score(self, prompt: str, completion: str, completion_ids: Sequence[int]) -> float:
        """One finished sample (the loop scores each as it finishes)."""
        return self.score_batch([prompt], [completion], [completion_ids])[0]

    def __call__(self, prompt: str, completion: str) -> float:
        """The text-only rule signature the loop's rule rewards have (no token ids: the
        functions get an empty ``completion_ids``; the worker calls :meth:`score`)."""
        return self.score(prompt, completion, [])


def resolve_reward_spec(spec: Mapping[str, Any], field: str = "models.reward"
                        ) -> RewardFunctions:
    """Import every function ``spec`` names and check it can take TRL's arguments; raise
    :class:`LoopConfigError` naming the field otherwise."""
    if "function" in spec and "functions" in spec:
        raise LoopConfigError(f"{field}: give function: (one) or functions: (a list), not both")
    if "function" in spec:
        return RewardFunctions([_entry(spec, field)])
    items = spec["functions"]
    extra = sorted(set(spec) - {"functions"})
    if extra:
        raise LoopConfigError(f"{field}: unknown keys {extra} beside functions:; known: "
                              "functions")
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        raise LoopConfigError(f"{field}.functions: {items!r}; give a non-empty list of "
                              "{function: module:name, weight: 1.0} entries")
    return RewardFunctions([_entry(item if isinstance(item, Mapping) else {"function": item},
                                   f"{field}.functions[{i}]") for i, item in enumerate(items)])


def _entry(item: Mapping[str, Any], field: str) -> _Entry:
    unknown = sorted(set(item) - {"function", "weight"})
    if unknown:
        raise LoopConfigError(f"{field}: unknown keys {unknown}; known: function, weight")
    weight = item.get("weight", 1.0)
    if isinstance(weight, str):
        try:
            weight = float(weight)
        except ValueError:
            pass
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(
            weight):
        raise LoopConfigError(f"{field}.weight: must be a finite number, got {weight!r}")
    ref = item["function"]
    fn = _import(ref, f"{field}.function")
    _check_signature(fn, ref, f"{field}.function")
    return _Entry(ref, fn, float(weight))


def _import(ref: Any, field: str) -> Callable[..., Any]:
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")):
        raise LoopConfigError(f"{field}: {ref!r}; write the import path as module:function, "
                              "e.g. my_pkg.rewards:math_reward")
    module_name, attr = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise LoopConfigError(f"{field}: {ref}: module {module_name} cannot be imported "
                              f"({exc}); install it or put its folder on PYTHONPATH") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise LoopConfigError(f"{field}: {ref}: {module_name} has no {attr}; check the "
                                  "name after the colon")
        obj = getattr(obj, part)
    if not callable(obj):
        raise LoopConfigError(f"{field}: {ref} is a {type(obj).__name__}, not a function")
    return obj


def _check_signature(fn: Callable[..., Any], ref: str, field: str) -> None:
    if inspect.iscoroutinefunction(fn):
        raise LoopConfigError(f"{field}: {ref} is async; the loop scores each sample as it "
                              "finishes and calls reward functions synchronously")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return   # a builtin or C callable: trust it
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                  inspect.Parameter.KEYWORD_ONLY)}
    missing = [a for a in _TRL_ARGS if a not in names]
    if missing:
        raise LoopConfigError(
            f"{field}: {ref} cannot take {', '.join(missing)}; write it as TRL's reward "
            "functions are: def f(prompts, completions, completion_ids, **kwargs) -> "
            "list[float], one reward per completion")
