"""``gae`` in place of OpenRLHF's ``RemoteExperienceMaker.get_advantages_and_returns``."""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...triton_kernels.gae import gae
from . import plugin_state

__all__ = ["fused_get_advantages_and_returns"]

_SAID: set[str] = set()


def _stock_once(reason: str) -> None:
    if reason not in _SAID:
        _SAID.add(reason)
        logging.getLogger("rlhf_fusion.openrlhf").warning(
            f"rlhf_fusion: --fusion.gae runs OpenRLHF's own get_advantages_and_returns for "
            f"{reason} (said once)")


@torch.no_grad()
def fused_get_advantages_and_returns(
    self: Any,
    values: torch.Tensor,
    rewards: torch.Tensor,
    action_mask: torch.Tensor | None,
    gamma: float,
    lambd: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenRLHF's signature and "zero" mask semantics (rewards and values multiplied by the
    mask, the recursion running through padding), by the blocked-matrix GAE.

    The stock loop computes in the promoted dtype of its inputs (at least float32, as the
    rewards are promoted before); ``gae`` computes in float32, so the result is cast to that
    dtype to keep everything downstream (whitening, the replay buffer) unchanged.
    """
    # Where the blocked form would differ from stock, run stock: gae refuses gamma/lambda
    # outside [0, 1] (stock accepts them), and a NaN/inf anywhere (padding included) makes
    # stock's advantages NaN, which the blocked form would not reproduce.
    reason = None
    if not (0.0 <= float(gamma) <= 1.0 and 0.0 <= float(lambd) <= 1.0):
        reason = f"gamma={gamma}, lambd={lambd} outside [0, 1]"
    elif not (bool(torch.isfinite(values).all()) and bool(torch.isfinite(rewards).all())):
        reason = "values or rewards with NaN/inf"
    if reason is not None:
        _stock_once(reason)
        stock = plugin_state.stock("gae", "get_advantages_and_returns")
        return stock(self, values, rewards, action_mask, gamma, lambd)
    out_dtype = torch.promote_types(torch.promote_types(values.dtype, rewards.dtype),
                                    torch.float32)
    adv, ret = gae(rewards, values, action_mask, gamma=float(gamma), lam=float(lambd),
                   semantics="zero")
    return adv.to(out_dtype).detach(), ret.to(out_dtype)
