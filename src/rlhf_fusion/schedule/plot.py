"""Timeline and memory plot of a schedule, like Figure 10 of the RLHFuse paper."""

from __future__ import annotations

from pathlib import Path

from .evaluate import validate
from .result import Schedule

_COLORS = [("#4C72B0", "#A6BDDB"), ("#DD8452", "#F5C6A5"), ("#55A868", "#B5DDB5")]


def plot_schedule(schedule: Schedule, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG: one timeline row per stage group (forward light, backward dark, one colour
    per model) above the activation memory of each group over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    problem = schedule.problem
    ev = validate(problem, schedule.order)
    n = problem.stage_groups
    fig, (ax, axm) = plt.subplots(
        2, 1, figsize=(14, 2.0 + 0.35 * n + 2.5), height_ratios=[0.35 * n + 1, 2.5], sharex=True
    )
    for g, tasks in enumerate(schedule.order):
        for t in tasks:
            s, e = ev.start[t], ev.end[t]
            dark, light = _COLORS[t.model % len(_COLORS)]
            ax.barh(g, e - s, left=s, height=0.8, color=light if t.op == "F" else dark,
                    edgecolor="white", linewidth=0.3)
            if e - s >= schedule.makespan / 120:
                ax.text((s + e) / 2, g, str(t.micro_batch), ha="center", va="center", fontsize=5)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"group {g}" for g in range(n)])
    ax.invert_yaxis()
    ax.axvline(schedule.lower_bound, color="red", linestyle="--", linewidth=1)
    legend = []
    for mi, m in enumerate(problem.models):
        dark, light = _COLORS[mi % len(_COLORS)]
        legend += [Patch(color=light, label=f"{m.name} F"), Patch(color=dark, label=f"{m.name} B")]
    legend.append(Patch(color="red", label=f"lower bound {schedule.lower_bound:g}"))
    ax.legend(handles=legend, loc="upper right", fontsize=7, ncol=len(legend))
    serial = schedule.baselines.get("serial_1f1b", {})
    ax.set_title(
        title
        or f"{problem.name or 'fused schedule'} - {schedule.solver}: makespan {schedule.makespan:g}"
        + (f" ({schedule.speedup():.2f}x vs serial 1F1B {serial['makespan']:g})" if serial else "")
    )
    # Memory: each group's level steps at its own task boundaries.
    for g, tasks in enumerate(schedule.order):
        xs, ys, level = [0.0], [0.0], 0.0
        for t in tasks:
            m = problem.models[t.model]
            a = m.activation[t.stage]
            if t.op == "F":
                xs.append(ev.start[t])
                ys.append(level)
                level += a
            else:
                xs.append(ev.end[t])
                ys.append(level)
                level -= a
            xs.append(xs[-1])
            ys.append(level)
        axm.plot(xs, ys, linewidth=0.8, label=f"group {g}" if n <= 8 else None)
    if serial.get("peak_activation"):
        axm.axhline(serial["peak_activation"], color="black", linestyle=":", linewidth=1,
                    label="serial 1F1B peak")
    axm.set_ylabel("activation memory")
    axm.set_xlabel("time")
    axm.legend(fontsize=6, ncol=5, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return path
