"""Tensor-parallel and ZeRO-3 plans run for real by the loop, against the estimator.

``placement_measured.py --real`` imports this. Each plan runs ``rlhf_fusion.loop.train`` on
``WORLD`` local gloo processes: real generation, scoring and PPO training, the training calls
on torch's DTensor (tp=2) or FSDP2 (ZeRO-3) engines, or whole copies (data parallel).

The prediction is the placement estimator's for the same plan and problem, from profiles
measured on this machine before the runs (ReaLHF's profiling-assisted estimator):

* every role's decoder layers on one process (``profile_models``, as ``rlhf-fusion
  profile-layers``);
* the Actor's and the Critic's training in each plan's layout on its ``WORLD`` ranks, as the
  loop trains (``runtime.layout_profile``): per micro-batch the layers' forward and backward
  with the layout's communication inside (tp all-reduces, FSDP gathers and reduce-scatters),
  the rest of a pass, what a mini-batch step adds (gradient sync, clipping, AdamW), and for a
  sharded layout the gather of whole weights its weight sync starts with; each figure the
  median over ``REPEATS`` starts of the processes, one at the start of each round of runs;
* the gloo link (bandwidth halved: the loop moves float32, the planner counts bf16 bytes).

Compared per part, from the loop's own metrics (median over the iterations after the first
of every run, ``REPEATS`` runs per plan in alternating order):

* ``training`` (the bar): ``time/training`` against ``actor_train + critic_train`` (both
  calls on the same ranks, one after the other);
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
    Layout,
    PlacementProblem,
    make_mesh,
    resolve_model,
)
from rlhf_fusion.placement.graph import CALLS, TRAIN_CALL
from rlhf_fusion.placement.profile import Profile
from rlhf_fusion.runtime.layout_profile import median_layouts
from rlhf_fusion.testing.emulate import local_hardware, measure_links

WORLD = 2
ITERATIONS = 4          # the first is warm-up (first allocations, first gathers)
REPEATS = 5             # rounds over the plans, in alternating order
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
    dp = Layout(WORLD, 1, 1)
    train = {"data parallel": dp, "train tp=2": Layout(1, WORLD, 1),
             "train ZeRO-3": Layout(WORLD, 1, 1, zero=3)}
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
                            profiles=profiles, gradient_checkpointing=False)


def combined_profiles(tmp: Path, rounds: int) -> dict[str, Any]:
    """Each role's profile of the first round, its layouts the median over the rounds."""
    out = {}
    for path in sorted((tmp / "profiles0").glob("*.json")):
        data = json.loads(path.read_text())
        if "layouts" in data:
            data["layouts"] = median_layouts([
                json.loads((tmp / f"profiles{r}" / path.name).read_text())["layouts"]
                for r in range(rounds)])
        out[path.stem] = Profile.from_dict(data, f"profile of {path.stem}")
    return out


def profile_summary(profiles: dict[str, Any], prob: PlacementProblem) -> dict[str, Any]:
    """Per trained role and profiled layout, at the loop's micro-batch: one pass (forward +
    backward, every layer and the rest), what a step adds and the gather, in seconds."""
    out: dict[str, Any] = {}
    tok = prob.micro_batch_tokens
    for role in ("actor", "critic"):
        m = prob.models[role]
        for key, lay in profiles[role].layouts.items():
            out.setdefault(role, {})[key] = {
                "pass_s": lay.train_pass(tok, m.layers),
                "step_s": lay.step_seconds(m.params),
                "gather_s": lay.gather_seconds(m.params) if lay.gather else None}
    return out


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
        cluster = problem(cfg0, hw, prompt_len, {}).cluster
        runs: dict[str, list[list[dict[str, float]]]] = {}
        walls: dict[str, list[float]] = {}
        the_plans = plans(cluster)
        paths = {}
        for name, plan in the_plans.items():
            paths[name] = Path(tmp) / f"{name.replace(' ', '_')}.json"
            plan.save(paths[name], cluster)
        # Rounds in alternating order: the machine's speed drifts, each plan sees both ends.
        # Each round starts with one launch of the layout profiles, so the profiles' medians
        # are taken over the same stretch of time as the runs.
        profile_s = 0.0
        for r in range(REPEATS):
            t0 = time.perf_counter()
            profile_models(model_configs(cfg0.models), seq_len=round(prompt_len) + GEN_LEN,
                           out=Path(tmp) / f"profiles{r}", layouts=LAYOUTS, world=WORLD)
            profile_s += time.perf_counter() - t0
            print(f"profiles, round {r + 1}: {time.perf_counter() - t0:.0f} s", flush=True)
            for name in (list(the_plans) if r % 2 == 0 else list(reversed(the_plans))):
                t0 = time.perf_counter()
                res = train(config(str(paths[name])), prompts, progress=False)
                walls.setdefault(name, []).append(time.perf_counter() - t0)
                runs.setdefault(name, []).append(res["history"][1:])   # warm-up dropped
                print(f"{name} round {r + 1}: training " + ", ".join(
                    f"{h['time/training']:.2f}" for h in res["history"]) + " s", flush=True)
        profiles = combined_profiles(Path(tmp), REPEATS)
        prob = problem(cfg0, hw, prompt_len, profiles)
        est = Estimator(prob)
        rows = []
        for name, plan in the_plans.items():
            pred = est.estimate(plan)
            hist = [h for run in runs[name] for h in run]
            p = {"training": sum(pred.call_time[c] for c in TRAIN_CALL.values()),
                 "weight_sync": sum(pred.realloc_time.values()),
                 "iteration": pred.iteration_time,
                 "rollout": sum(pred.call_time[c] for c in CALLS
                                if c not in TRAIN_CALL.values())}
            m = {k: statistics.median(h[f"time/{k}"] for h in hist) for k in p}
            per_run = [statistics.median(h["time/training"] for h in run) / p["training"]
                       for run in runs[name]]
            rows.append({"plan": name, "table": plan.table(), "measured_s": m,
                         "predicted_s": p,
                         "ratio": {k: (m[k] / p[k] if p[k] else None) for k in m},
                         "training_ratio_per_run": per_run,
                         "training_s": [h["time/training"] for h in hist],
                         "weight_sync_s": [h["time/weight_sync"] for h in hist],
                         "iterations_s": [h["time/iteration"] for h in hist],
                         "wall_s": walls[name], "call_time_s": pred.call_time,
                         "realloc_time_s": pred.realloc_time,
                         "realloc_bytes": hist[-1]["realloc/bytes"]})
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
    return {"profiles": profile_summary(profiles, prob), "profile_s": profile_s,
            "launches": REPEATS, "world": WORLD, "model": MODEL, "batch": BATCH,
            "gen_len": GEN_LEN, "prompt_len": prompt_len,
            "micro_batch_tokens": prob.micro_batch_tokens,
            "ppo": {"epochs": EPOCHS, "mini_batches": MINI, "micro_batches": MICRO},
            "iterations": ITERATIONS, "repeats": REPEATS, "link": link.to_dict(),
            "hardware": hw.to_dict(), "rows": rows, "bar": BAR}


def _ok(rep: dict[str, Any], ratio: float | None) -> bool:
    return ratio is not None and abs(ratio - 1) <= rep["bar"]


def markdown(rep: dict[str, Any]) -> str:
    L = ["# Tensor-parallel and ZeRO-3 plans run for real (the loop) vs the estimator", "",
         f"{rep['date']}, {rep['machine']['cpu']} ({rep['machine']['cpu_cores']} cores, "
         f"1-minute load average {rep['load_before']:.2f} before, {rep['load_after']:.2f} "
         f"after), torch {rep['machine']['torch']}; {rep['world']} gloo processes, one thread "
         f"each. Command: `{rep['command']}`.", "",
         f"`rlhf_fusion.loop.train` on each plan: Actor/Critic {rep['model']}, "
         f"{rep['batch']} prompts x {rep['gen_len']} new tokens, PPO {rep['ppo']}, "
         f"{rep['iterations']} iterations, {rep['repeats']} runs per plan in alternating order "
         f"(medians over iterations 2-{rep['iterations']} of every run). "
         "Predicted: the placement estimator for the same plan, from profiles measured here "
         f"first ({rep['profile_s']:.0f} s): the layers on one process, the Actor's and the "
         f"Critic's training in each plan's layout on its {rep['world']} ranks (medians over "
         f"{rep['launches']} starts of the processes, one before each round of runs), the "
         "gloo link "
         f"({rep['link']['concurrent_bandwidth'] / 1e9:.2f} GB/s, latency "
         f"{rep['link']['latency_s'] * 1e6:.0f} us).", "",
         "| plan | training: measured / predicted s (ratio) | ratio per run | training within "
         f"{rep['bar']:.0%} | weight sync: measured / predicted s | iteration: measured / "
         "predicted s (ratio) |",
         "|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        m, p, q = r["measured_s"], r["predicted_s"], r["ratio"]
        L.append(f"| {r['plan']} | {m['training']:.3f} / {p['training']:.3f} "
                 f"({q['training']:.2f}) | "
                 + ", ".join(f"{x:.2f}" for x in r["training_ratio_per_run"])
                 + f" | {'yes' if _ok(rep, q['training']) else '**no**'} | "
                 f"{m['weight_sync']:.3f} / {p['weight_sync']:.3f} | "
                 f"{m['iteration']:.3f} / {p['iteration']:.3f} ({q['iteration']:.2f}) |")
    L.append("")
    if rep.get("png"):
        L += [f"![measured vs predicted]({rep['png']})", ""]
    prof = rep.get("profiles") or {}
    if prof:
        L += [f"## The profiles at the loop's micro-batch ({rep['micro_batch_tokens']} tokens), "
              "per rank", "",
              "| role | layout | one pass (forward + backward) ms | a step adds ms | "
              "gather whole weights ms |", "|---|---|---|---|---|"]
        for role, lays in prof.items():
            for key, v in lays.items():
                g = "" if v["gather_s"] is None else f"{v['gather_s'] * 1e3:.1f}"
                L.append(f"| {role} | {key} | {v['pass_s'] * 1e3:.1f} | "
                         f"{v['step_s'] * 1e3:.1f} | {g} |")
        L.append("")
    for r in rep["rows"]:
        L += [f"### {r['plan']}", "", "```", r["table"], "```", "",
              "training (s): " + ", ".join(f"{x:.2f}" for x in r["training_s"])
              + "; weight sync (s): " + ", ".join(f"{x:.3f}" for x in r["weight_sync_s"])
              + "; iterations (s): " + ", ".join(f"{x:.2f}" for x in r["iterations_s"]), ""]
    for note in rep.get("notes", []):
        L += [note, ""]
    return "\n".join(L).rstrip() + "\n"


def notes(rep: dict[str, Any]) -> list[str]:
    """What the figures say, from the figures."""
    rows = {r["plan"]: r for r in rep["rows"]}
    dp = rows["data parallel"]
    out = ["## Reading the figures",
           "- **Training** (the calls whose layout the plans change) is costed from the layout "
           "profiles alone: per micro-batch the measured pass, per mini-batch the measured "
           "step. Relative to the data-parallel plan, measured / predicted: " + "; ".join(
               f"{r['plan']} {r['vs_dp']['measured']:.2f} / {r['vs_dp']['predicted']:.2f}"
               for r in rep["rows"] if r is not dp) + ".",
           "- **Run to run**, the same plan's training moves by "
           + ", ".join(f"{r['plan']} {min(r['training_s']):.2f}-{max(r['training_s']):.2f} s"
                       for r in rep["rows"])
           + " (two processes on 2 cores: where a process lands in memory and caches moves a "
           "pass by up to a fifth; the profiles take medians over "
           f"{rep['launches']} starts for that reason).",
           "- **Weight sync** from a sharded layout is the measured gather of whole weights "
           "(a collective per parameter) plus the planner's transfer between whole copies; "
           "the data-parallel plan's weight sync (the copy into the generation model) has no "
           "reallocation node, so it is predicted 0.",
           "- **Generation and scoring** are costed for GPUs (decode steps that read the "
           "weights from HBM); here a decode step is Python-bound: rollout measured / "
           "predicted " + ", ".join(
               f"{r['plan']} {r['measured_s']['rollout']:.2f} / "
               f"{r['predicted_s']['rollout']:.2f} s" for r in rep["rows"])
           + ". The iteration row inherits that."]
    return out


def plot(rep: dict[str, Any], path: Path) -> None:
    """Measured (bars) and predicted (markers) training, weight sync and iteration per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [("training", "training"), ("weight_sync", "weight sync"),
             ("iteration", "iteration")]
    fig, axes = plt.subplots(1, len(parts), figsize=(11, 3.4))
    names = [r["plan"] for r in rep["rows"]]
    for ax, (key, title) in zip(axes, parts):
        meas = [r["measured_s"][key] for r in rep["rows"]]
        pred = [r["predicted_s"][key] for r in rep["rows"]]
        xs = range(len(names))
        ax.bar(xs, meas, color="#4c72b0", label="measured (median)")
        ax.scatter(xs, pred, color="#dd8452", marker="D", zorder=3, label="predicted")
        if key == "training":
            for x, p in zip(xs, pred):
                ax.plot([x - 0.4, x + 0.4], [p * (1 + rep["bar"])] * 2, color="#dd8452",
                        lw=0.8, ls="--")
                ax.plot([x - 0.4, x + 0.4], [p * (1 - rep["bar"])] * 2, color="#dd8452",
                        lw=0.8, ls="--")
        ax.set_xticks(list(xs), names, rotation=15, fontsize=8)
        ax.set_title(f"{title} (s)", fontsize=10)
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("loop on 2 gloo ranks: measured vs the estimator (dashed: +/-"
                 f"{rep['bar']:.0%} of predicted training)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rep: dict[str, Any], out: Path, name: str = "placement_measured_real") -> None:
    out.mkdir(parents=True, exist_ok=True)
    try:
        plot(rep, out / f"{name}.png")
        rep["png"] = f"{name}.png"
    except ImportError:
        rep["png"] = None
    (out / f"{name}.json").write_text(json.dumps(rep, indent=1, default=str) + "\n")
    (out / f"{name}.md").write_text(markdown(rep))


def main_real(out: Path, machine: dict[str, Any], load0: float | None = None) -> int:
    load0 = os.getloadavg()[0] if load0 is None else load0
    rep = run_real(out)
    rep.update({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine,
                "load_before": load0, "load_after": os.getloadavg()[0],
                "command": "OMP_NUM_THREADS=1 python benchmarks/placement_measured.py --real"})
    rep["notes"] = notes(rep)
    write(rep, out)
    print(markdown(rep))
    return 0 if all(r["ratio"]["training"] is not None
                    and abs(r["ratio"]["training"] - 1) <= BAR for r in rep["rows"]) else 1
