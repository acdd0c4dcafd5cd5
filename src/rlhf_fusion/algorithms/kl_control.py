"""KL coefficient controllers: fixed, and the adaptive controller of Ziegler et al. 2019
(https://arxiv.org/abs/1909.08593, section 2.2) as verl (``algorithm.kl_ctrl.type:
adaptive``), OpenRLHF (``--kl_target``) and TRL's former ``PPOTrainer`` have it.

After each batch, with ``current`` the batch's KL and ``n_steps`` its samples:
``value *= 1 + clip(current / target - 1, -0.2, 0.2) * n_steps / horizon``: the coefficient
grows while the policy is further from its reference than ``target`` and shrinks while it is
closer, by at most 20% per ``horizon`` samples.

What ``current`` measures is the caller's choice; the loop passes verl's (``apply_kl_penalty``):
the per-token KL averaged over each response, then over the batch, so ``target_kl`` is in nats
per token (TRL's former trainer summed over the response instead). Plain floats, no torch: the
result equals verl's and OpenRLHF's numpy arithmetic bit for bit.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AdaptiveKLController", "FixedKLController", "kl_controller"]


class FixedKLController:
    """A constant coefficient; :meth:`update` does nothing."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> None:
        """Nothing: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Ziegler et al.'s proportional controller (verl's and OpenRLHF's argument names:
    ``init_kl_coef``, ``target`` = verl's ``target_kl``, ``horizon``)."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if not target > 0:
            raise ValueError(f"AdaptiveKLController: target must be > 0, got {target}")
        if not horizon > 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        super().__init__(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current: float, n_steps: int) -> None:
        """One batch of ``n_steps`` samples whose KL was ``current``."""
        error = min(max(float(current) / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def kl_controller(kl_coef: float, *, adaptive: bool, target: float = 0.1,
                  horizon: float = 10000) -> FixedKLController:
    """The controller a run config asks for (``algorithm.kl_ctrl``, ``target_kl``,
    ``kl_horizon``)."""
    if adaptive:
        return AdaptiveKLController(kl_coef, target, horizon)
    return FixedKLController(kl_coef)
