"""Pictures of a run: one iteration's per-rank timeline (fused beside serial, as RLHFuse's
Figures 5 and 10) and the reward curve."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLORS = {"sync": "#9e9e9e", "generation": "#1f77b4", "inference": "#ff7f0e",
          "advantages": "#8c564b", "training": "#2ca02c"}
# The pipeline's instructions inside training, when the engine traced them.
PIPELINE_COLORS = {("actor", "F"): "#98df8a", ("actor", "B"): "#2ca02c",
                   ("critic", "F"): "#c5b0d5", ("critic", "B"): "#9467bd"}
PIPELINE_LABELS = {("actor", "F"): "Actor forward", ("actor", "B"): "Actor backward",
                   ("critic", "F"): "Critic forward", ("critic", "B"): "Critic backward"}
IDLE = "#eeeeee"
# The breakdown (``compare_png``, ``demo --compare``):
# Stage seconds per iteration (wall, the slowest rank), in the order an iteration runs them.
STAGES = (("time/weight_sync", "weight sync"), ("time/rollout", "generation + inference"),
          ("time/advantages", "advantages"), ("time/training", "training"))
# Rank-seconds summed over the ranks: what the ranks did with the time.
ACCOUNTS = (("time/decode", "decode steps"), ("time/scoring", "scoring calls"),
            ("time/rollout_idle", "rollout: waiting"), ("time/train_compute", "pipeline F/B"),
            ("time/train_idle", "training: bubbles, transfers, optimizer"))


def segments(tl: dict[str, Any], rank: int) -> list[tuple[str, float, float]]:
    """``(stage, start, end)`` of one rank in one iteration, seconds from its start. With the
    pipeline's trace (``train_ranks``), training is its forward/backward instructions,
    ``("actor F", a, b)`` etc.; whatever no segment covers is idle."""
    out = [("sync", *tl["sync"])]
    r0, r1 = tl["rollout"]
    ranks = tl.get("ranks") or []
    st = ranks[rank] if rank < len(ranks) else {}
    gen_end = st.get("generation_end_s")
    inf_start = st.get("inference_start_s")
    local_end = st.get("local_end_s")
    if gen_end is None:
        out.append(("generation", r0, r1))
    else:
        out.append(("generation", r0, r0 + gen_end))
        if inf_start is not None and local_end is not None and local_end > inf_start:
            out.append(("inference", r0 + inf_start, r0 + local_end))
    out.append(("advantages", *tl["advantages"]))
    events = (tl.get("train_ranks") or [])
    mine = events[rank] if rank < len(events) else []
    if mine:
        for name, a, b in mine:
            model, op = _instruction(name)
            out.append((f"{model} {op}", a, b))
    else:
        out.append(("training", *tl["training"]))
    return out


def _instruction(name: str) -> tuple[str, str]:
    """``actor0:1F3`` -> ``("actor", "F")``."""
    model = name.split(":", 1)[0].rstrip("0123456789")
    op = name.split(":", 1)[1].lstrip("0123456789")[:1]
    return model, op


def _color(stage: str) -> str:
    if " " in stage:
        model, op = stage.split(" ")
        return PIPELINE_COLORS.get((model, op), COLORS["training"])
    return COLORS[stage]


def timeline_png(runs: Sequence[tuple[str, dict[str, Any]]], world: int, path: str | Path,
                 *, of: int | None = None) -> Path:
    """One iteration per panel (``runs``: ``(title, timeline)``), a row per rank; ``of``: the
    run's iteration count, for the title. Idle time (a rank waiting for a peer, a pipeline
    bubble) is the grey left between the bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.5 + 0.8 * world * len(runs)),
                             sharex=True, squeeze=False)
    used: set[str] = set()
    for ax, (title, tl) in zip(axes[:, 0], runs, strict=True):
        end = tl["training"][1]
        for r in range(world):
            ax.barh(r, end, left=0, color=IDLE, edgecolor="none", height=0.8)
            for stage, a, b in segments(tl, r):
                ax.barh(r, b - a, left=a, color=_color(stage), edgecolor="white",
                        linewidth=0.3, height=0.8)
                used.add(stage)
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
        ax.invert_yaxis()
        it = tl.get("iteration")
        which = "" if it is None else f", iteration {it}"
        if it is not None and of and it == of - 1 and of > 1:
            which += f" (the last of {of}; 0 is the first)"
        ax.set_title(f"{title}{which}: {end:.2f} s")
    axes[-1, 0].set_xlabel("seconds since the iteration started")
    legend = [(c, s) for s, c in COLORS.items() if s in used]
    legend += [(PIPELINE_COLORS[k], v) for k, v in PIPELINE_LABELS.items()
               if f"{k[0]} {k[1]}" in used]
    legend.append((IDLE, "idle (waiting for a peer, pipeline bubble)"))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c, _ in legend]
    rows = 2 if len(legend) > 5 else 1
    fig.legend(handles, [n for _, n in legend], loc="upper center",
               ncol=(len(legend) + rows - 1) // rows, frameon=False, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92 if rows == 1 else 0.86))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compare_png(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """``demo --compare``'s breakdown: per pair, fused beside serial, the stage seconds summed
    over the iterations (left) and what the ranks did with their time (right, rank-seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels = []
    for i, row in enumerate(rows):
        for j, mode in enumerate(("fused", "serial")):
            x = 2.5 * i + j
            labels.append((x, f"{row['pair']} {mode}"))
            for ax, keys in ((left, STAGES), (right, ACCOUNTS)):
                bottom = 0.0
                for k, (key, name) in enumerate(keys):
                    v = row[mode]["stages"].get(key, 0.0)
                    ax.bar(x, v, bottom=bottom, color=plt.cm.tab10(k if ax is left else k + 4),
                           label=name if x == 0 else None, width=0.9)
                    bottom += v
        left.text(2.5 * i + 0.5, max(row["fused"]["iteration_s"], row["serial"]["iteration_s"]),
                  f"{row['ratio']:.2f}x", ha="center", va="bottom", fontsize=9)
    for ax, title, unit in ((left, "iteration time by stage", "seconds, summed over iterations"),
                            (right, "where the ranks' time went", "rank-seconds")):
        ax.set_xticks([x for x, _ in labels], [n for _, n in labels], rotation=30, fontsize=8)
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    ratios = [r["ratio"] for r in rows]
    fig.suptitle(f"rlhf-fusion demo: serial/fused total iteration time, median "
                 f"{statistics.median(ratios):.2f}x over {len(rows)} alternating pairs")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def reward_png(history: Sequence[dict[str, float]], path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [h["iteration"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(its, [h["objective/scores"] for h in history], marker="o", label="reward (score)")
    ax.plot(its, [h["objective/rlhf_reward"] for h in history], ls="--",
            label="score - KL penalty")
    ax.set_xlabel("iteration")
    ax.set_ylabel("mean over the batch")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def grpo_compare_png(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """``demo --algo grpo --compare``'s breakdown: per pair, fused beside serial, the rollout
    (generation + Ref and reward scoring) and the training seconds summed over the
    iterations; above each pair its rollout ratio beside the simulator's bound, and the
    training ratio (the same work in both modes: how much the machine's load moved)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("fused", "serial", "balanced") if all("balanced" in r for r in rows) else (
        "fused", "serial")
    names = {"fused": "fused", "serial": "static", "balanced": "balanced"} if len(modes) == 3 \
        else {m: m for m in modes}
    step = len(modes) + 0.5
    fig, ax = plt.subplots(figsize=(2.6 + 0.8 * len(modes) * len(rows), 4.6))
    ticks = []
    for i, row in enumerate(rows):
        for j, mode in enumerate(modes):
            x = step * i + j
            ticks.append((x, f"{row['pair']} {names[mode]}"))
            t = row[mode]
            ax.bar(x, t["rollout_s"], color=COLORS["generation"], width=0.9,
                   label="generation + Ref and reward scoring" if x == 0 else None)
            ax.bar(x, t["train_s"], bottom=t["rollout_s"], color=COLORS["training"], width=0.9,
                   label="training" if x == 0 else None)
        top = max(row[m]["rollout_s"] + row[m]["train_s"] for m in modes)
        bound = f" (bound {row['bound']:.2f}x)" if row.get("bound") else ""
        static = (f"\nstatic split {row['static_rollout_ratio']:.2f}x"
                  if "static_rollout_ratio" in row else "")
        ax.text(step * i + (len(modes) - 1) / 2, top,
                f"rollout {row['rollout_ratio']:.2f}x{bound}{static}\n"
                f"training {row['training_ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks([x for x, _ in ticks], [n for _, n in ticks], rotation=30, fontsize=8)
    ax.set_ylabel("seconds, summed over iterations")
    ax.margins(y=0.25)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2,
              frameon=False)
    ax.set_title("GRPO: serial/fused per pair (training is the same work: the load control)"
                 + ("\nserial: balanced scoring (the bar's baseline) and the static split"
                    if len(modes) == 3 else ""), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
