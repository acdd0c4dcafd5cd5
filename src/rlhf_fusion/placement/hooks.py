"""Costs from our own fused simulators instead of the analytic formulas.

* Rollout (``Fusion.rollout``): the Actor's generation runs through the inter-stage simulator
  (``rollout.planning.simulate``) with one instance per data-parallel replica, the decode-step
  and prefill costs of ``CostModel`` and the response lengths of the problem (lognormal, or all
  ``gen_len``), so the long tail and continuous batching are in the estimate. Inference calls
  placed on the generation mesh with the generation strategy are scored on the generation
  instances, fused with it (the simulator's R_t migration; the best R_t over a grid, or no
  migration when that is faster), and cost nothing on their own.
* Training (``Fusion.train``): Actor and Critic training on the same mesh run as one fused
  pipeline; the analytic times of the two are scaled by fused makespan / serial 1F1B makespan
  of the ``schedule`` problem ``derive_problem`` builds from their (dp, pp, tp) (the greedy
  schedule: milliseconds, and within a few percent of the bound on these shapes).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .costs import CostModel
from .graph import CALL_MODEL
from .layout import Layout
from .mesh import DeviceMesh

RT_POINTS = 7


def response_lengths(cost: CostModel) -> np.ndarray:
    p = cost.p
    if p.length_median is None:
        return np.full(p.batch, p.gen_len, dtype=np.int64)
    from ..rollout.planning import lognormal_quantile_lengths

    return lognormal_quantile_lengths(p.batch, p.length_median, p.length_sigma, max_len=p.gen_len)


def rollout_time(cost: CostModel, mesh: DeviceMesh, s: Layout,
                 absorbed: tuple[str, ...], resident: float | None = None) -> tuple[float, dict]:
    """Seconds of generation (plus the ``absorbed`` inference calls, fused) on ``mesh``."""
    from ..rollout.planning import ClusterModel, rt_grid, simulate_fused, simulate_serial

    p = cost.p
    hw = cost.hw(mesh)
    base, per_sample, per_kv = cost.decode_step(mesh, s)
    b = math.ceil(p.batch / s.dp)
    bs_max = math.ceil(b / cost.gen_rounds(mesh, s, resident))
    infer = sum(2 * p.models[CALL_MODEL[c]].params
                for c in absorbed) / (s.tp * s.pp * hw.flops * hw.infer_mfu)
    cm = ClusterModel(instances=s.dp, bs_max=bs_max, step_base_s=base,
                      step_per_sample_s=per_sample, step_per_kv_token_s=per_kv,
                      prefill_per_token_s=cost.prefill_per_token(mesh, s),
                      infer_per_token_s=infer, kv_bytes_per_token=p.models["actor"].kv_bytes_per_token,
                      bandwidth_bytes_s=hw.ib_bw, latency_s=hw.link_latency_s,
                      prompt_len=p.prompt_len)
    lengths = response_lengths(cost)
    serial = simulate_serial(lengths, cm)
    total, gen_end, _ = serial
    if not absorbed:
        return gen_end, {"generation_s": gen_end}
    best, rt_best = total, None
    if s.dp >= 2:
        for rt in rt_grid(p.batch, points=RT_POINTS):
            r = simulate_fused(lengths, cm, rt, serial=serial)
            if r.fused_s < best:
                best, rt_best = r.fused_s, rt
    return best, {"generation_s": gen_end, "serial_rollout_s": total, "fused_rollout_s": best,
                  "rt": rt_best, "absorbed": list(absorbed)}


@lru_cache(maxsize=4096)
def _fused_ratio(pa: float, pc: float, dp: int, pp: int, tp: int, mbs: int, batch: int,
                 seq: int) -> float:
    from ..schedule import ProblemError, greedy
    from ..schedule.baselines import serial_1f1b
    from ..schedule.evaluate import CompiledProblem
    from .layout import Layout
    from .pipeline_problem import ModelConfig, derive_problem

    if pp == 1:
        return 1.0
    try:
        lay = Layout(dp=dp, tp=tp, pp=pp)
        prob = derive_problem(ModelConfig("actor", pa, lay, mbs),
                              ModelConfig("critic", pc, lay, mbs),
                              global_batch=batch, tokens_per_sample=seq)
    except ProblemError:
        return 1.0
    cp = CompiledProblem(prob)
    fused = cp.makespan(cp.ids(greedy(prob)))
    serial, _ = serial_1f1b(prob)
    if fused is None or serial <= 0:
        return 1.0
    return min(1.0, fused / serial)


def fused_train_ratio(cost: CostModel, s_actor: Layout, s_critic: Layout
                      ) -> float:
    """Fused / serial time of Actor + Critic training on one mesh (1.0 when not fusable:
    different strategies, or no pipeline)."""
    p = cost.p
    if s_actor != s_critic:
        return 1.0
    per_replica = p.batch // p.ppo_minibatches // s_actor.dp
    mbs = max(1, min(cost.micro_batch(), per_replica))
    batch = (p.batch // p.ppo_minibatches) // (s_actor.dp * mbs) * (s_actor.dp * mbs)
    if batch < s_actor.dp * mbs:
        return 1.0
    return _fused_ratio(p.models["actor"].params, p.models["critic"].params, s_actor.dp,
                        s_actor.pp, s_actor.tp, mbs, batch, p.seq_len)
