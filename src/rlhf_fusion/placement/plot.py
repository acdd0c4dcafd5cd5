"""Timeline PNGs: one row per device mesh a plan uses, a bar per call (reallocations hatched),
plans stacked so the searched plan sits under the co-located heuristic."""

from __future__ import annotations

from pathlib import Path

from .estimate import Estimate
from .plan import ExecutionPlan

COLORS = {"actor_gen": "#4C72B0", "ref_inf": "#8172B3", "reward_inf": "#CCB974",
          "critic_inf": "#64B5CD", "actor_train": "#C44E52", "critic_train": "#55A868"}


def plot_timelines(items: list[tuple[str, ExecutionPlan, Estimate]], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    heights = []
    for _, plan, _ in items:
        heights.append(len({plan.calls[c].mesh.ranks for c in plan.call_names}) + 1)
    fig, axes = plt.subplots(len(items), 1, figsize=(12, 1.0 + 0.55 * sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    xmax = max(e.timeline.makespan for _, _, e in items if e.timeline is not None)
    for ax, (title, plan, est) in zip(axes[:, 0], items):
        tl = est.timeline
        assert tl is not None, "estimate(keep_timeline=True) is needed to plot"
        meshes = sorted({plan.calls[c].mesh for c in plan.call_names}, key=lambda m: (-m.size, m.ranks))
        row = {m.ranks: i for i, m in enumerate(meshes)}
        labels = [f"{m.name} ({m.size})" for m in meshes]
        for node, s, e in zip(tl.nodes, tl.start, tl.end):
            if e - s <= 0:
                continue
            if node.kind == "realloc":
                call = node.name.split("->")[1].split("@")[0]
                y = row[plan.calls[call].mesh.ranks]
                ax.barh(y, e - s, left=s, height=0.35, color="white", edgecolor="black",
                        hatch="//", align="edge")
                continue
            call = node.name.split("@")[0]
            y = row[plan.calls[call].mesh.ranks]
            ax.barh(y, e - s, left=s, height=0.8, color=COLORS[call], edgecolor="black",
                    alpha=1.0 if node.iteration % 2 == 0 else 0.65)
            if e - s > xmax / 40:
                ax.text(s + (e - s) / 2, y, f"{call}@{node.iteration}", ha="center",
                        va="center", fontsize=7)
        ax.set_yticks(range(len(meshes)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, xmax * 1.02)
        ax.set_title(f"{title}: {est.iteration_time:.1f} s/iteration"
                     + (" (OOM)" if est.oom else ""), fontsize=10)
    axes[-1, 0].set_xlabel("seconds (two iterations, Algorithm 1)")
    shown = {c for _, plan, _ in items for c in plan.call_names}
    handles = [Patch(color=v, label=k) for k, v in COLORS.items() if k in shown]
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="reallocation"))
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=8)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
