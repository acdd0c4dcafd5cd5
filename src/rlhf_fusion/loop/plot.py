"""Pictures of a run: one iteration's per-rank timeline (fused beside serial, as RLHFuse's
Figures 5 and 10) and the reward curve."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLORS = {"sync": "#9e9e9e", "generation": "#1f77b4", "inference": "#ff7f0e",
          "advantages": "#8c564b", "training": "#2ca02c"}


def segments(tl: dict[str, Any], rank: int) -> list[tuple[str, float, float]]:
    """``(stage, start, end)`` of one rank in one iteration, seconds from its start."""
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
    out.append(("training", *tl["training"]))
    return out


def timeline_png(runs: Sequence[tuple[str, dict[str, Any]]], world: int, path: str | Path
                 ) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.2 + 0.7 * world * len(runs)),
                             sharex=True, squeeze=False)
    for ax, (title, tl) in zip(axes[:, 0], runs, strict=True):
        for r in range(world):
            for stage, a, b in segments(tl, r):
                ax.barh(r, b - a, left=a, color=COLORS[stage], edgecolor="white", height=0.8)
        end = tl["training"][1]
        ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
        ax.invert_yaxis()
        ax.set_title(f"{title}: {end:.2f} s")
    axes[-1, 0].set_xlabel("seconds since the iteration started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper center", ncol=len(COLORS), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
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
