"""Tensor-parallel and ZeRO-3 plans run for real by the loop, against the estimator.

``placement_measured.py --real`` imports this. Each plan runs ``rlhf_fusion.loop.train`` on
``WORLD`` local gloo processes: real generation, scoring and PPO training, the training calls
on torch's DTensor (tp=2) or FSDP2 (ZeRO-3) engines. The prediction is the placement
estimator's for the same plan and problem, with the Actor's and Critic's layers profiled on
this CPU first (``placement.profile``'s :func:`~rlhf_fusion.loop.placement.profile_models`,
one thread as each rank has) and the link figures of this machine's gloo (bandwidth halved:
the loop moves float32, the planner counts bf16 bytes).

Compared per part, from the loop's own metrics (median over the iterations after the first):

* ``training``: ``time/training`` against ``actor_train + critic_train`` (both calls on the
  same ranks, one after the other);
* ``weight sync``: ``time/weight_sync`` against the plan's reallocation nodes;
* the whole iteration: ``time/iteration`` against the estimator's iteration time. Generation
  and scoring are costed for GPUs (decode steps reading the weights from HBM, prefill at a
  FLOP rate); on this CPU a decode step is Python-bound, so this row is reported, not
  tuned.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rlhf_fusion.loop import (
    FusionLoopConfig,
    GenerationConfig,
    ModelsConfig,
    PlacementSection,
    PPOLoopConfig,
    RLHFConfig,
    train,
)
from rlhf_fusion.loop.demo import demo_prompts
from rlhf_fusion.loop.models import load_tokenizer, model_configs, model_shapes
from rlhf_fusion.loop.placement import profile_models
from rlhf_fusion.placement import (
    CallPlacement,
    Cluster,
    DeviceGroup,
    Estimator,
    ExecutionPlan,
    ParallelStrategy,
    PlacementProblem,
    make_mesh,
    resolve_model,
)
from rlhf_fusion.placement.graph import CALLS, TRAIN_CALL
from rlhf_fusion.runtime.emulate import local_hardware, measure_links

WORLD = 2
ITERATIONS = 4          # the first is warm-up (first allocations, first gathers)
REPEATS = 3             # rounds over the plans, in alternating order
LAUNCHES = 3            # the layout profiles: medians over this many starts of the processes
BATCH, GEN_LEN, MINI, EPOCHS, MICRO = 16, 32, 2, 2, 2
MODEL = {"family": "llama", "layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2}
BAR = 0.20
# The training layouts of the plans below, (dp, tp, zero): profiled on WORLD ranks as they run.
LAYOUTS = [(WORLD, 1, 0), (1, WORLD, 0), (WORLD, 1, 3)]


def config(plan: str | None, iterations: int = ITERATIONS) -> RLHFConfig:
    return RLHFConfig(
        models=ModelsConfig(actor=dict(MODEL), reward="vowels", seed=0),
        generation=GenerationConfig(prompts_per_iteration=BATCH, max_new_tokens=GEN_LEN,
                                    seed=0),
        ppo=PPOLoopConfig(num_ppo_epochs=EPOCHS, num_mini_batches=MINI, micro_batches=MICRO,
                          learning_rate=1e-4),
        fusion=FusionLoopConfig(inter=False, intra=False, timeout_s=300.0),
        placement=PlacementSection(plan=plan), world_size=WORLD, iterations=iterations)


def plans(cluster: Cluster) -> dict[str, ExecutionPlan]:
    """dp=2 everywhere; training tp=2; training ZeRO-3 over both ranks (generation and
    inference data parallel on both ranks in all three)."""
    mesh = make_mesh(cluster, "main", 0, 1)
    dp = ParallelStrategy(WORLD, 1, 1)
    train = {"data parallel": dp, "train tp=2": ParallelStrategy(1, WORLD, 1),
             "train ZeRO-3": ParallelStrategy(WORLD, 1, 1, zero=3)}
    return {name: ExecutionPlan({c: CallPlacement(mesh, s if c in TRAIN_CALL.values() else dp)
                                 for c in CALLS}, name)
            for name, s in train.items()}


def problem(cfg: RLHFConfig, hw: Any, prompt_len: float, profiles: dict[str, Any]
            ) -> PlacementProblem:
    shapes = {role: resolve_model(sh, f"models.{role}")
              for role, sh in model_shapes(model_configs(cfg.models)).items()}
    seq = round(prompt_len) + GEN_LEN
    cluster = Cluster((DeviceGroup("main", 1, dataclasses.replace(hw, gpus_per_node=WORLD),
                                   WORLD),))
    # micro_batch_tokens: the loop's micro-batch (a mini-batch / MICRO samples).
    return PlacementProblem(models=shapes, cluster=cluster, batch=BATCH,
                            prompt_len=max(1, round(prompt_len)), gen_len=GEN_LEN,
                            ppo_minibatches=MINI, ppo_epochs=EPOCHS,
                            micro_batch_tokens=BATCH // MINI // MICRO * seq, name="real",
                            profiles=profiles)


def _engine_rank(rank: int, world: int) -> dict[str, float]:
    """One micro-batch's forward + backward of the benchmark's Actor on this rank: a whole
    copy, the tp=2 model (DTensor) and the ZeRO-3 model (FSDP2); and a small all-reduce."""
    import copy

    import torch.distributed as dist

    from rlhf_fusion.loop.models import build_causal_lm
    from rlhf_fusion.runtime.sharded_train import TrainLayout, layout_groups, shard_for_training

    conf = model_configs(config(None).models)["actor"]
    base = build_causal_lm(conf, seed=0).train()
    ids = torch.randint(2, conf.vocab_size, (BATCH // MINI // MICRO, 52))
    out = {}
    y = torch.zeros(8)
    for _ in range(10):
        dist.all_reduce(y)
    t = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(y)
    out["allreduce_small_ms"] = (time.perf_counter() - t) / 200 * 1e3
    ranks = tuple(range(world))
    for kind, lay in (("whole", None), ("tp=2", TrainLayout(ranks, 1, world)),
                      ("ZeRO-3", TrainLayout(ranks, world, 1, 3))):
        model = copy.deepcopy(base)
        if lay is not None:
            groups = {g: dist.group.WORLD for g in layout_groups(lay)}
            shard_for_training(model, "actor", lay, rank, groups, torch.device("cpu"))
        for i in range(7):
            if i == 2:
                t = time.perf_counter()
            model(input_ids=ids).logits.sum().backward()
        out[f"{kind}_fwd_bwd_ms"] = (time.perf_counter() - t) / 5 * 1e3
    return out


def engine_overhead() -> dict[str, float]:
    """:func:`_engine_rank` on WORLD ranks (rank 0's figures)."""
    from rlhf_fusion.launch import run_ranks

    return run_ranks(_engine_rank, WORLD, timeout=600.0)[0].value


def _median(history: list[dict[str, float]], key: str) -> float:
    return statistics.median(h[key] for h in history[1:])


def run_real(out: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg0 = config(None)
    tok = load_tokenizer(cfg0.models)
    prompts = demo_prompts()
    prompt_len = statistics.fmean(len(tok.encode(p)) for p in prompts[:BATCH])
    link = measure_links(WORLD)
    # FLOP/s and HBM figures only cost generation here (training and scoring come from the
    # profiles): a CPU core's order of magnitude.
    hw = local_hardware(flops=5e10, hbm_bw=1e10, link=link, byte_scale=2.0,
                        gpus_per_node=WORLD)
    with tempfile.TemporaryDirectory() as tmp:
        profiles = profile_models(model_configs(cfg0.models), seq_len=round(prompt_len)
                                  + GEN_LEN, out=Path(tmp) / "profiles",
                                  layouts=LAYOUTS, world=WORLD, launches=LAUNCHES)
        prob = problem(cfg0, hw, prompt_len, profiles)
        est = Estimator(prob)
        runs: dict[str, list[dict[str, float]]] = {}
        walls: dict[str, list[float]] = {}
        the_plans = plans(prob.cluster)
        paths = {}
        for name, plan in the_plans.items():
            paths[name] = Path(tmp) / f"{name.replace(' ', '_')}.json"
            plan.save(paths[name], prob.cluster)
        # Rounds in alternating order: the machine's load drifts, each plan sees both ends.
        for r in range(REPEATS):
            for name in (list(the_plans) if r % 2 == 0 else list(reversed(the_plans))):
                t0 = time.perf_counter()
                res = train(config(str(paths[name])), prompts, progress=False)
                walls.setdefault(name, []).append(time.perf_counter() - t0)
                runs.setdefault(name, []).extend(res["history"][1:])   # warm-up dropped
                print(f"{name} round {r + 1}: " + ", ".join(
                    f"{h['time/training']:.2f}" for h in res["history"]), flush=True)
        rows = []
        for name, plan in the_plans.items():
            pred = est.estimate(plan)
            hist = runs[name]
            p_train = sum(pred.call_time[c] for c in TRAIN_CALL.values())
            p_sync = sum(pred.realloc_time.values())
            m = {k: statistics.median(h[f"time/{k}"] for h in hist)
                 for k in ("training", "weight_sync", "iteration", "rollout")}
            p = {"training": p_train, "weight_sync": p_sync,
                 "iteration": pred.iteration_time,
                 "rollout": sum(pred.call_time[c] for c in CALLS
                                if c not in TRAIN_CALL.values())}
            row = {"plan": name, "table": plan.table(), "measured_s": m, "predicted_s": p,
                   "ratio": {k: (m[k] / p[k] if p[k] else None) for k in m},
                   "training_s": [h["time/training"] for h in hist],
                   "iterations_s": [h["time/iteration"] for h in hist], "wall_s": walls[name],
                   "call_time_s": pred.call_time, "realloc_time_s": pred.realloc_time,
                   "realloc_bytes": hist[-1]["realloc/bytes"]}
            rows.append(row)
        base = rows[0]
        for row in rows:   # each plan against the data-parallel plan, measured and predicted
            row["vs_dp"] = {
                "measured": row["measured_s"]["training"] / base["measured_s"]["training"],
                "predicted": row["predicted_s"]["training"] / base["predicted_s"]["training"]}
            print(f"{row['plan']}: training measured {row['measured_s']['training']:.3f} s "
                  f"predicted {row['predicted_s']['training']:.3f} s "
                  f"({row['ratio']['training']:.2f}); vs dp measured "
                  f"{row['vs_dp']['measured']:.2f} predicted {row['vs_dp']['predicted']:.2f}",
                  flush=True)
    engines = engine_overhead()
    print(f"engines: {engines}", flush=True)
    return {"engines": engines, "world": WORLD, "model": MODEL, "batch": BATCH, "gen_len": GEN_LEN,
            "prompt_len": prompt_len, "ppo": {"epochs": EPOCHS, "mini_batches": MINI,
                                              "micro_batches": MICRO},
            "iterations": ITERATIONS, "repeats": REPEATS, "link": link.to_dict(), "hardware": hw.to_dict(),
            "rows": rows, "bar": BAR}


def markdown(rep: dict[str, Any]) -> str:
    L = ["# Tensor-parallel and ZeRO-3 plans run for real (the loop) vs the estimator", "",
         f"{rep['date']}, {rep['machine']['cpu']} ({rep['machine']['cpu_cores']} cores, "
         f"shared with other work: 1-minute load average {rep['load_before']:.2f} before, "
         f"{rep['load_after']:.2f} after), torch {rep['machine']['torch']}; "
         f"{rep['world']} gloo processes, one thread each. Command: `{rep['command']}`.", "",
         f"`rlhf_fusion.loop.train` on each plan: Actor/Critic {rep['model']}, "
         f"{rep['batch']} prompts x {rep['gen_len']} new tokens, PPO {rep['ppo']}, "
         f"{rep['iterations']} iterations, {rep['repeats']} runs per plan in alternating order "
         f"(medians over iterations 2-{rep['iterations']} of every run). "
         "Predicted: the placement estimator for the same plan, layers profiled on this CPU "
         "(one thread), gloo link figures measured at the start "
         f"({rep['link']['concurrent_bandwidth'] / 1e9:.2f} GB/s, latency "
         f"{rep['link']['latency_s'] * 1e6:.0f} us).", "",
         "| plan | training: measured / predicted s (ratio) | training vs the dp plan: "
         "measured / predicted | weight sync: measured / predicted s | iteration: measured / "
         "predicted s (ratio) | training within 20% |",
         "|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        m, p, q = r["measured_s"], r["predicted_s"], r["ratio"]
        ok = q["training"] is not None and abs(q["training"] - 1) <= rep["bar"]
        L.append(f"| {r['plan']} | {m['training']:.3f} / {p['training']:.3f} "
                 f"({q['training']:.2f}) | {r['vs_dp']['measured']:.2f} / "
                 f"{r['vs_dp']['predicted']:.2f} | {m['weight_sync']:.3f} / {p['weight_sync']:.3f} | "
                 f"{m['iteration']:.3f} / {p['iteration']:.3f} ({q['iteration']:.2f}) | "
                 f"{'yes' if ok else '**no**'} |")
    L.append("")
    for r in rep["rows"]:
        L += [f"### {r['plan']}", "", "```", r["table"], "```", "",
              "training (s): " + ", ".join(f"{x:.2f}" for x in r["training_s"])
              + "; iterations (s): " + ", ".join(f"{x:.2f}" for x in r["iterations_s"])
              + f"; weights moved by the reallocation per iteration: "
              f"{r['realloc_bytes'] / 1e6:.2f} MB", ""]
    e = rep.get("engines")
    if e:
        L += ["## The engines alone (one micro-batch of the Actor, forward + backward, per rank)",
              "", "| layout | ms |", "|---|---|"]
        L += [f"| {k.removesuffix('_fwd_bwd_ms')} | {v:.1f} |" for k, v in e.items()
              if k.endswith("_fwd_bwd_ms")]
        L += ["", f"A gloo all-reduce of 8 floats between the two ranks: "
              f"{e['allreduce_small_ms']:.2f} ms (the estimator's link latency: "
              f"{rep['link']['latency_s'] * 1e3:.3f} ms, half a ping-pong at the start).", ""]
    for note in rep.get("notes", []):
        L += [note, ""]
    return "\n".join(L).rstrip() + "\n"


def notes(rep: dict[str, Any]) -> list[str]:
    """What the figures say, from the figures."""
    rows = {r["plan"]: r for r in rep["rows"]}
    dp = rows["data parallel"]
    out = ["## Reading the figures",
           f"- **The data-parallel plan's ratio is this machine's factor.** That plan (no "
           f"DTensor, no FSDP) measures {dp['ratio']['training']:.2f}x its predicted "
           "training time. The profiles are timed in one process at one moment; the loop "
           "runs two processes on one thread each, on 2 cores that other jobs share (load "
           f"average {rep['load_before']:.1f} before, {rep['load_after']:.1f} after). The "
           "runs of one plan spread as far as "
           + ", ".join(f"{r['plan']} {min(r['training_s']):.2f}-{max(r['training_s']):.2f} s"
                       for r in rep["rows"]) + ".",
           "- **Relative to the data-parallel plan run alongside**, training time measured / "
           "predicted: " + "; ".join(
               f"{r['plan']} {r['vs_dp']['measured']:.2f} / {r['vs_dp']['predicted']:.2f}"
               for r in rep["rows"] if r is not dp) + "."]
    e = rep.get("engines")
    if e:
        out.append(
            f"- **What a layout costs on this CPU** (the engines alone, above): one micro-batch "
            f"of the tp=2 model takes {e['tp=2_fwd_bwd_ms']:.0f} ms per rank against "
            f"{e['whole_fwd_bwd_ms']:.0f} ms for a whole copy, and every tp rank runs every "
            "micro-batch; the estimator evaluates the profile at tokens / tp, i.e. assumes a "
            "tp rank's layer time halves. ZeRO-3 takes "
            f"{e['ZeRO-3_fwd_bwd_ms']:.0f} ms: FSDP2 gathers each layer before its forward and "
            "backward and reduce-scatters after, each a gloo collective of "
            f"{e['allreduce_small_ms']:.2f} ms latency or more here, plus its per-unit Python "
            "hooks, which the cost model has no term for.")
    out.append(
        "- **Generation and scoring** are costed for GPUs (decode steps that read the weights "
        "from HBM); here a decode step is Python-bound: rollout measured / predicted "
        + ", ".join(f"{r['plan']} {r['measured_s']['rollout']:.2f} / "
                    f"{r['predicted_s']['rollout']:.2f} s" for r in rep["rows"]) + ".")
    return out


def write(rep: dict[str, Any], out: Path, name: str = "placement_measured_real") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown(rep))


def main_real(out: Path, machine: dict[str, Any]) -> int:
    load0 = os.getloadavg()[0]
    rep = run_real(out)
    rep.update({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine,
                "load_before": load0, "load_after": os.getloadavg()[0],
                "command": "OMP_NUM_THREADS=1 python benchmarks/placement_measured.py --real"})
    rep["notes"] = notes(rep)
    write(rep, out)
    print(markdown(rep))
    return 0 if all(r["ratio"]["training"] is not None
                    and abs(r["ratio"]["training"] - 1) <= BAR for r in rep["rows"]) else 1
