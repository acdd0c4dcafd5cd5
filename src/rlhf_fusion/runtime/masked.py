"""Masked reductions over per-token tensors, shared by the PPO losses (:mod:`.ppo`), the loop's
advantages and the TRL trainer's experience.

Each has one switch, ``trl_exact``: TRL's own arithmetic step for step, where the TRL trainer
must match stock TRL bit for bit. The two differ only at the edges: what an empty mask gives
and what masked positions hold.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["masked_mean", "whiten"]


def masked_mean(values: Tensor, mask: Tensor, *, trl_exact: bool = False) -> Tensor:
    """The mean of ``values`` where ``mask`` is set, over every dimension.

    An empty mask gives 0 (a micro-batch without actions adds nothing to a loss); with
    ``trl_exact``, NaN, as TRL's ``masked_mean``.
    """
    if trl_exact:
        return (values * mask).sum() / mask.sum()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True,
           trl_exact: bool = False) -> Tensor:
    """Normalise the masked entries to mean 0 and unit variance (unbiased variance, ``1e-8``
    in the root, as TRL's ``masked_whiten``); ``shift_mean=False`` adds the mean back.

    Masked positions come out 0, and one entry alone is not rescaled by ``n / (n - 1)``. With
    ``trl_exact``: TRL's ``masked_whiten`` bit for bit: masked positions keep their whitened
    values, one entry divides by zero and an empty mask raises.
    """
    if trl_exact:
        mean = masked_mean(values, mask, trl_exact=True)
        var = masked_mean((values - mean) ** 2, mask, trl_exact=True)
        n = mask.sum()
        if n == 0:
            raise ValueError("whitening over an empty mask: raise mini_batch_size or "
                             "gradient_accumulation_steps")
        var = var * (n / (n - 1))
        out = (values - mean) * torch.rsqrt(var + 1e-8)
        return out if shift_mean else out + mean
    m = mask.to(values.dtype)
    n = m.sum()
    mean = (values * m).sum() / n
    var = ((values - mean).square() * m).sum() / n
    var = var * n / (n - 1) if n > 1 else var
    out = (values - mean) * torch.rsqrt(var + 1e-8)
    return (out if shift_mean else out + mean) * m
