"""Records every GAE call of a verl job (harness only; ``VERL_USE_EXTERNAL_MODULES``).

Once verl's trainer module that calls GAE (``verl.trainer.ppo.ray_trainer``, used by the v1
trainer's ``compute_advantage_for_multi_trajectories`` too) is imported, this wraps whatever
``core_algos.compute_gae_advantage_return`` is then (ours when ``RLHF_FUSION_VERL=gae`` turned the
plugin on, verl's otherwise) and saves, per call, the inputs, that function's outputs and verl's
own function's outputs on the same inputs to ``$VERL_GAE_RECORD_DIR/gae_<pid>_<n>.pt``.
"""

from __future__ import annotations

import os

TARGET = "verl.trainer.ppo.ray_trainer"


def _wrap() -> None:
    import torch
    import verl.trainer.ppo.core_algos as core_algos

    current = core_algos.compute_gae_advantage_return
    try:
        from rlhf_fusion.integrations.verl import gae_plugin

        fused = current is gae_plugin.fused_compute_gae_advantage_return
        stock = gae_plugin.stock_gae() if fused else current
    except ImportError:
        fused, stock = False, current
    out_dir = os.environ["VERL_GAE_RECORD_DIR"]
    os.makedirs(out_dir, exist_ok=True)
    calls = [0]

    def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
        adv, ret = current(token_level_rewards, values, response_mask, gamma, lam)
        s_adv, s_ret = stock(token_level_rewards, values, response_mask, gamma, lam)
        calls[0] += 1
        torch.save({"fused": fused, "function": f"{current.__module__}.{current.__name__}",
                    "rewards": token_level_rewards, "values": values, "mask": response_mask,
                    "gamma": gamma, "lam": lam, "advantages": adv, "returns": ret,
                    "stock_advantages": s_adv, "stock_returns": s_ret},
                   os.path.join(out_dir, f"gae_{os.getpid()}_{calls[0]}.pt"))
        return adv, ret

    core_algos.compute_gae_advantage_return = compute_gae_advantage_return


if os.environ.get("VERL_GAE_RECORD_DIR"):
    from rlhf_fusion.integrations.verl.hooks import after_import

    after_import(TARGET, lambda _module: _wrap())
