"""The blocked GAE in place of verl's ``core_algos.compute_gae_advantage_return``.

verl's function is a reverse Python loop over the response with "skip" mask semantics (masked
positions carry the running advantage and the next value through), then ``returns = advantages
+ values`` and ``verl_F.masked_whiten(advantages, response_mask)``. This one computes the same
advantages with :func:`rlhf_fusion.triton_kernels.gae.gae` (``semantics="skip"``: the Triton
kernel on CUDA, the blocked matrix form on CPU) and then does the rest exactly as verl does, with
verl's own ``masked_whiten``.

Equality: in float32 the blocked form rounds differently from the loop. On verl's inputs
(float32 rewards and values, a 0/1 response mask) the returns (and the advantages before
whitening) agree with verl's to ``|ours - verl| <= 1e-5 * (1 + |verl|)`` elementwise; verl's
own loop is within the same bound of a float64 loop. Whitening divides by the advantages' std,
so the whitened advantages agree to ``1e-5 * (1 + M) / std * (2 + |verl|)`` (``M`` the largest
raw advantage, ``std`` their std over response tokens). tests/test_verl_plugins.py checks both
on right padding and multi-turn holes, verl's defaults (gamma = lam = 1) and tuned values;
measured, the worst case uses a fifth of the first bound and a fiftieth of the second.

Where the blocked form cannot reproduce verl exactly, verl's own function runs (said once per
reason): inputs that are not float32 (verl's loop computes in their dtype), gamma or lambda
outside [0, 1], NaN/inf, or a mask with values other than 0 and 1 (verl's loop weights by it).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from types import ModuleType
from typing import Any

import torch

from ...triton_kernels.gae import gae
from .compat import check_gae_call_site, check_gae_seam, check_version
from .hooks import after_import
from .state import PATCHED

__all__ = ["CORE_ALGOS", "fused_compute_gae_advantage_return", "install", "install_now",
           "stock_gae", "uninstall"]

CORE_ALGOS = "verl.trainer.ppo.core_algos"
RAY_TRAINER = "verl.trainer.ppo.ray_trainer"

_STOCK: dict[str, Any] = {}
_SAID: set[str] = set()
LOG = logging.getLogger("rlhf_fusion.verl")


def stock_gae() -> Any:
    """verl's own ``compute_gae_advantage_return`` (the one this replaced)."""
    return _STOCK["compute_gae_advantage_return"]


def _stock_once(reason: str) -> None:
    if reason not in _SAID:
        _SAID.add(reason)
        LOG.warning(f"rlhf_fusion: RLHF_FUSION_VERL=gae runs verl's own "
                    f"compute_gae_advantage_return for {reason} (said once)")


def _as_float(x: Any) -> float | None:
    if isinstance(x, torch.Tensor):
        return float(x.item()) if x.numel() == 1 else None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _why_stock(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               gamma: float | None, lam: float | None) -> str | None:
    if rewards.dtype != torch.float32 or values.dtype != torch.float32:
        return f"{rewards.dtype}/{values.dtype} rewards/values (not float32)"
    if rewards.dim() != 2 or rewards.shape != values.shape or mask.shape != rewards.shape:
        return f"shapes {tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
    if gamma is None or lam is None or not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        return f"gamma={gamma}, lam={lam} (not scalars in [0, 1])"
    if not (bool(torch.isfinite(rewards).all()) and bool(torch.isfinite(values).all())):
        return "rewards or values with NaN/inf"
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        return "a response_mask with values other than 0 and 1"
    return None


def fused_compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: Any,
    lam: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's signature and results: ``(masked_whiten(advantages), advantages + values)``."""
    g, lm = _as_float(gamma), _as_float(lam)
    reason = _why_stock(token_level_rewards, values, response_mask, g, lm)
    if reason is not None:
        _stock_once(reason)
        return stock_gae()(token_level_rewards, values, response_mask, gamma, lam)
    import verl.utils.torch_functional as verl_F

    with torch.no_grad():
        advantages, returns = gae(token_level_rewards, values, response_mask, gamma=g, lam=lm,
                                  semantics="skip")
        advantages = verl_F.masked_whiten(advantages, response_mask)
    return advantages, returns


def install(core_algos: ModuleType) -> None:
    """Replace ``core_algos.compute_gae_advantage_return`` (and the registry's ``"gae"`` entry,
    so that ``get_adv_estimator_fn("gae")`` agrees) after checking the seam; idempotent."""
    if "gae" in PATCHED:
        return
    version = check_version()
    check_gae_seam(core_algos, version)
    # the call site once ray_trainer is imported (now if it is): a failure fails that import
    after_import(RAY_TRAINER, lambda ray_trainer: check_gae_call_site(ray_trainer, version))
    stock = core_algos.compute_gae_advantage_return
    _STOCK["compute_gae_advantage_return"] = stock
    core_algos.compute_gae_advantage_return = fused_compute_gae_advantage_return
    registry = getattr(core_algos, "ADV_ESTIMATOR_REGISTRY", {})
    if registry.get("gae") is stock:
        registry["gae"] = fused_compute_gae_advantage_return
    PATCHED.add("gae")


def install_now(where: str) -> None:
    """Import core_algos and install now, logging the one line (the Hydra key's path)."""
    if "gae" in PATCHED:
        return
    install(importlib.import_module(CORE_ALGOS))
    LOG.warning(f"rlhf_fusion: verl plugins gae on in pid {os.getpid()} "
                f"(verl {check_version()}, from {where})")


def uninstall() -> None:
    """Put verl's own GAE back (tests; a process that turns the plugin off)."""
    core_algos = sys.modules.get(CORE_ALGOS)
    stock = _STOCK.pop("compute_gae_advantage_return", None)
    if core_algos is not None and stock is not None:
        fused = core_algos.compute_gae_advantage_return
        core_algos.compute_gae_advantage_return = stock
        registry = getattr(core_algos, "ADV_ESTIMATOR_REGISTRY", {})
        if registry.get("gae") is fused:
            registry["gae"] = stock
    PATCHED.discard("gae")
