"""``gae`` in place of OpenRLHF's ``RemoteExperienceMaker.get_advantages_and_returns``."""

from __future__ import annotations

from typing import Any

import torch

from ...triton_kernels.gae import gae

__all__ = ["fused_get_advantages_and_returns"]


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
    out_dtype = torch.promote_types(torch.promote_types(values.dtype, rewards.dtype),
                                    torch.float32)
    adv, ret = gae(rewards, values, action_mask, gamma=float(gamma), lam=float(lambd),
                   semantics="zero")
    return adv.to(out_dtype).detach(), ret.to(out_dtype)
