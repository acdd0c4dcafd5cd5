"""Derive a fused pipeline problem from model sizes and each model's (dp, pp, tp).

Both models train on the same G GPUs (dp * pp * tp equal). A stage group is a set of GPUs
running one stage of each model; when the tensor-parallel degrees differ, tp_big = s * tp_small,
every s consecutive stages of the model with the smaller tp are merged into one stage that spans
the same tp_big GPUs as the other model's stages (RLHFuse section 5.2). The fused pipeline then
spans N = lcm(pp_1, pp_2') groups and holds K_i = N / pp_i' copies of each model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..schedule.problem import Problem, ProblemError
from .layout import Layout


@dataclass(frozen=True)
class ModelConfig:
    """A model of the fused pipeline: its size and its training :class:`Layout` (dp, pp, tp)."""

    name: str
    params: float  # parameter count, e.g. 33e9
    layout: Layout
    micro_batch_size: int = 1
    direction: str = "forward"


def derive_problem(
    actor: ModelConfig,
    critic: ModelConfig,
    *,
    global_batch: int,
    tokens_per_sample: int = 1024,
    gpu_flops: float = 300e12,
    activation_bytes_per_token_param: float = 2.0 / 1e9,
    name: str = "",
) -> Problem:
    """Build the problem for one fused pipeline.

    Forward time of a stage is ``2 * params_per_stage * tokens / (tp * gpu_flops)`` and the
    backward twice that; activation memory per micro-batch is proportional to the stage's share
    of the model per GPU. The absolute units do not matter to the planner, only the ratios.
    """
    models = [actor, critic]
    for m in models:   # (the degrees were checked by their Layout)
        v = m.micro_batch_size
        if not isinstance(v, int) or v < 1:
            raise ProblemError(f"{m.name}.micro_batch_size: must be a positive integer, "
                               f"got {v!r}")
    gpus = [m.layout.size for m in models]
    if gpus[0] != gpus[1]:
        per = critic.layout.pp * critic.layout.tp
        want = gpus[0] // per if gpus[0] % per == 0 else None
        fix = f"set {critic.name}.dp to {want}" if want else "make dp*pp*tp equal"
        raise ProblemError(
            f"{actor.name} uses dp*pp*tp = {gpus[0]} GPUs but {critic.name} uses {gpus[1]}; "
            f"fused models share the same GPUs: {fix}"
        )
    big, small = (actor, critic) if actor.layout.tp >= critic.layout.tp else (critic, actor)
    if big.layout.tp % small.layout.tp:
        raise ProblemError(
            f"tp: {big.name}.tp={big.layout.tp} is not a multiple of {small.name}.tp={small.layout.tp}; "
            "choose tensor-parallel degrees where one divides the other"
        )
    s = big.layout.tp // small.layout.tp
    if small.layout.pp % s:
        raise ProblemError(
            f"{small.name}.pp={small.layout.pp} must be divisible by tp ratio {s} "
            f"({big.name}.tp / {small.name}.tp) so its stages can be merged in groups of {s}; "
            f"choose {small.name}.pp as a multiple of {s}"
        )
    eff_pp = {actor.name: actor.layout.pp, critic.name: critic.layout.pp}
    eff_pp[small.name] = small.layout.pp // s
    n = math.lcm(eff_pp[actor.name], eff_pp[critic.name])
    specs = []
    for m, direction in ((actor, "forward"), (critic, "reverse")):
        samples_per_replica = global_batch / m.layout.dp
        if global_batch % (m.layout.dp * m.micro_batch_size):
            raise ProblemError(
                f"global_batch={global_batch} is not divisible by {m.name}.dp * micro_batch_size "
                f"= {m.layout.dp * m.micro_batch_size}; choose a multiple"
            )
        micro_batches = int(samples_per_replica // m.micro_batch_size)
        pp = eff_pp[m.name]
        copies = n // pp
        # Copies inside one fused pipeline are data-parallel replicas: they split the batch.
        per_copy = micro_batches * (n // pp) // copies
        tokens = m.micro_batch_size * tokens_per_sample
        fwd = 2 * (m.params / pp) * tokens / (big.layout.tp * gpu_flops)
        act = activation_bytes_per_token_param * tokens * (m.params / pp) / big.layout.tp
        specs.append({
            "name": m.name, "pipeline_stages": pp, "copies": copies,
            "micro_batches": per_copy, "forward": fwd, "backward": 2 * fwd,
            "activation": act, "direction": direction, "size": m.params,
        })
    # K1*M1 = K2*M2: both models see the same samples within one fused pipeline.
    a, c = specs
    if a["copies"] * a["micro_batches"] * actor.micro_batch_size != c["copies"] * c["micro_batches"] * critic.micro_batch_size:
        raise ProblemError(
            f"{actor.name} and {critic.name} process different sample counts per fused pipeline; "
            "use the same micro_batch_size for both"
        )
    if a["copies"] * a["micro_batches"] != c["copies"] * c["micro_batches"]:
        raise ProblemError("micro-batch counts differ between models; use the same micro_batch_size")
    return Problem.from_dict({"name": name, "stage_groups": n, "models": specs})
