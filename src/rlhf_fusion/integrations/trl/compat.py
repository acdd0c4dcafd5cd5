"""Which TRL versions the fused GRPO/RLOO trainers support, and the check that says so early.

The fused trainers override private TRL methods (the seams listed in :data:`GRPO_SEAMS` and
:data:`RLOO_SEAMS`). Private signatures change between releases (GRPO's
``_generate_single_turn`` gained ``num_generations`` in 1.14), so every construction checks the
installed signatures first: an unsupported TRL fails with the installed version and the
supported range, instead of a ``TypeError`` deep inside the first training step.
:func:`generation_copy` copies a policy without what a TRL release patched onto the instance.
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import RLHFFusionError

__all__ = [
    "GRPO_SEAMS",
    "RLOO_SEAMS",
    "SUPPORTED_TRL",
    "TRLCompatError",
    "check_trl_seams",
    "generation_copy",
    "logps_options",
    "trl_version",
    "uses_fused_lm_head",
]

SUPPORTED_TRL = ("1.12", "1.16")
"""Oldest and newest supported TRL minor versions (inclusive)."""

# Each seam: the accepted positional parameter lists after ``self`` (a prefix match for the
# last entry of a list ending in "..."). The trainer module must also define ``gather``.
Seams = Mapping[str, Sequence[Sequence[str]]]

GRPO_SEAMS: Seams = {
    "_generate_and_score_completions": [("inputs",)],
    "_generate_single_turn": [
        ("prompt_ids", "images", "multimodal_fields", "has_tool_images"),  # 1.12, 1.13
        ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    ],
    "_calculate_rewards": [("inputs", "prompts", "completions", "completion_ids_list")],
    "_get_per_token_logps_and_entropies": [
        ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
         "compute_entropy", "...")],
}
RLOO_SEAMS: Seams = {
    "_generate_and_score_completions": [("inputs",)],
    "_generate_single_turn": [("prompt_ids", "images", "multimodal_fields")],
    "_calculate_rewards": [("inputs", "prompts", "completions", "completion_ids_list")],
    "_get_per_token_logps_and_entropies": [
        ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
         "compute_entropy", "...")],
}


class TRLCompatError(RLHFFusionError, RuntimeError):
    """The installed TRL does not have the private methods the fused trainers override."""


def trl_version() -> str:
    try:
        import trl

        return str(trl.__version__)
    except Exception:  # pragma: no cover - trl missing is reported by the import itself
        return "unknown"


def _minor(version: str) -> tuple[int, int] | None:
    try:
        major, minor = version.split(".")[:2]
        return int(major), int("".join(ch for ch in minor if ch.isdigit()))
    except (ValueError, IndexError):
        return None


def _params(fn: object) -> tuple[str, ...]:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return tuple(p.name for p in sig.parameters.values() if p.name != "self")


def _matches(have: tuple[str, ...], want: Sequence[str]) -> bool:
    if want and want[-1] == "...":
        return have[: len(want) - 1] == tuple(want[:-1])
    return have == tuple(want)


def check_trl_seams(stock: type, seams: Seams) -> None:
    """Raise :class:`TRLCompatError` unless ``stock`` has every seam with a known signature.

    A TRL outside :data:`SUPPORTED_TRL` whose seams still match only warns: the check is on
    what the override needs, the version range on what was tested.
    """
    version = trl_version()
    lo, hi = SUPPORTED_TRL
    where = (f"installed TRL {version}; rlhf-fusion's fused {stock.__name__} supports TRL "
             f"{lo} through {hi}")
    problems = []
    for name, accepted in seams.items():
        fn = _seam_impl(stock, name)
        if fn is None:
            problems.append(f"{stock.__name__}.{name} is missing")
            continue
        have = _params(fn)
        if not any(_matches(have, want) for want in accepted):
            shown = " or ".join(f"({', '.join(w)})" for w in accepted)
            problems.append(f"{stock.__name__}.{name}({', '.join(have)}) where ({shown}) "
                            "was expected")
    module = sys.modules.get(stock.__module__)
    if module is None or not callable(getattr(module, "gather", None)):
        problems.append(f"{stock.__module__}.gather is missing")
    if problems:
        raise TRLCompatError(
            f"{where}; its private API differs: " + "; ".join(problems) +
            f". Install a supported TRL (pip install 'trl>={lo},<{_next(hi)}') or pass "
            "fusion=FusionConfig.off() and use the stock trainer.")
    v, lo_v, hi_v = _minor(version), _minor(lo), _minor(hi)
    if v is not None and lo_v is not None and hi_v is not None and not lo_v <= v <= hi_v:
        warnings.warn(f"{where}; the methods it overrides still match, so it runs, but this "
                      "combination is untested", stacklevel=3)


def logps_options(stock: type) -> tuple[str, ...]:
    """The parameters of ``stock._get_per_token_logps_and_entropies`` after ``logits_to_keep``
    (``batch_size``, ``compute_entropy``, then per version ``compute_aux_loss`` and the
    multimodal inputs), in order, so positional arguments can be named."""
    return _params(_seam_impl(stock, "_get_per_token_logps_and_entropies"))[4:]


def _seam_impl(stock: type, name: str) -> object | None:
    """The function whose parameters are ``stock.name``'s API.

    TRL 1.14's GRPO ``_get_per_token_logps_and_entropies(model, *args, batch_size=None,
    compute_aux_loss=False, **kwargs)`` only dispatches: everything but Liger goes to
    ``_full_logits_logps`` with the arguments unchanged, so that method's parameters are the
    ones callers (TRL's and ours) pass.
    """
    fn = getattr(stock, name, None)
    if name == "_get_per_token_logps_and_entropies" and fn is not None:
        impl = getattr(stock, "_full_logits_logps", None)
        if impl is not None and _params(fn)[1:2] == ("args",):
            return impl
    return fn


def uses_fused_lm_head(stock: type) -> bool:
    """Whether this TRL scores logprobs through its fused LM head (TRL >= 1.16: the trainer
    patches the policy's and Ref's ``forward`` with ``add_fused_lm_head`` and calls
    ``model(..., labels=..., fused_lm_head=True)``) rather than from the model's logits."""
    module = sys.modules.get(stock.__module__)
    return callable(getattr(module, "add_fused_lm_head", None))


def generation_copy(policy: Any) -> Any:
    """A copy of ``policy`` that runs its own classes' code and nothing of the live model.

    ``copy.deepcopy`` keeps per-instance method overrides, and those can close over the live
    model: TRL 1.16's ``add_fused_lm_head`` sets ``policy.forward`` to a function that calls the
    original bound ``forward`` of the live policy, so a deepcopy's forward would run the live
    model (train mode, its own attention, no paged KV). Every module of the copy drops such
    instance attributes that shadow a method of its class.
    """
    import copy

    import torch

    clone = copy.deepcopy(policy)
    for module in clone.modules():
        for name, value in list(vars(module).items()):
            if (callable(value) and not isinstance(value, torch.nn.Module)
                    and callable(getattr(type(module), name, None))):
                delattr(module, name)
    return clone


def _next(version: str) -> str:
    major, minor = version.split(".")
    return f"{major}.{int(minor) + 1}"
