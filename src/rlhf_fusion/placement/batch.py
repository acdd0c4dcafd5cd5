"""The largest batch that fits, per strategy (FlexRLHF V-A: "the batch size for each experiment
is set to the maximum value before Out of Memory"), and the throughput there.

The batch is a whole number of samples per GPU of the training group (DeepSpeed-Chat's
per-device batch times the world size). It doubles until the plan overflows a GPU (or reaches
``max_per_gpu``), then bisects to the largest that fits; the memory model grows with the batch
(``PlacementProblem.whole_batch``), so fitting is monotone in the batch. Throughput is batch /
estimated iteration time.

``refit`` says whether strategies are chosen again at every batch (Megatron: the smallest
model-parallel degree that fits this batch) or once at one sample per GPU and then kept
(DeepSpeed-Chat: the ZeRO stage and hybrid-engine mode are picked by model size, then the
batch is raised).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .errors import PlacementError
from .estimate import Estimate, Estimator
from .plan import ExecutionPlan
from .problem import PlacementProblem

Builder = Callable[[PlacementProblem, Estimator], ExecutionPlan]


@dataclass
class BatchResult:
    batch: int                      # samples per iteration at the largest batch that fits
    per_gpu: int
    plan: ExecutionPlan
    estimate: Estimate
    tried: list[tuple[int, float, bool]] = field(default_factory=list)  # (batch, s, oom)

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.batch / self.estimate.iteration_time


def max_batch(problem: PlacementProblem, build: Builder, *, refit: bool,
              max_per_gpu: int = 1024) -> BatchResult | None:
    """The largest batch at which ``build``'s plan fits, or None when one sample per GPU does
    not fit."""
    unit = problem.cluster.train_group.size
    fixed: ExecutionPlan | None = None
    tried: list[tuple[int, float, bool]] = []
    cache: dict[int, tuple[ExecutionPlan, Estimate] | None] = {}

    def at(k: int) -> tuple[ExecutionPlan, Estimate] | None:
        nonlocal fixed
        if k in cache:
            return cache[k]
        p = replace(problem, batch=k * unit)
        est = Estimator(p)
        try:
            plan = build(p, est) if (refit or fixed is None) else fixed
        except PlacementError:
            cache[k] = None
            return None
        if fixed is None:
            fixed = plan
        e = est.estimate(plan, keep_timeline=False)
        tried.append((k * unit, e.iteration_time, e.oom))
        cache[k] = None if e.oom else (plan, e)
        return cache[k]

    if at(1) is None:
        return None
    lo, hi = 1, None
    k = 2
    while k <= max_per_gpu:
        if at(k) is None:
            hi = k
            break
        lo = k
        k *= 2
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if at(mid) is None:
                hi = mid
            else:
                lo = mid
    plan, e = cache[lo]  # type: ignore[misc]
    final = Estimator(replace(problem, batch=lo * unit)).estimate(plan)
    return BatchResult(lo * unit, lo, plan, final, sorted(tried))
