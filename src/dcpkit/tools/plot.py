"""``dcpkit plot``: loss, learning rate and checkpoint stall of one or more runs, as one PNG.

Runs overlay on the same axes, so a run that was interrupted and resumed lies on top of the one
that was not; a resume is a vertical line (with the world size it resumed at) and checkpoints are
markers on the loss curve (filled circles: synchronous, triangles: asynchronous, diamonds: the
memory tier).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcpkit.runlog import Run, read_run

_STYLES = ["-", "--", ":", "-."]
_MARKERS = {"sync": ("o", True), "async": ("^", False), "memory-tier": ("D", False)}
"""Checkpoint kind -> (marker, filled)."""


def _kind(save: dict) -> str:
    if save.get("tier") == "memory":
        return "memory-tier"
    return "sync" if save.get("mode") == "sync" else "async"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plotting needs matplotlib: pip install 'dcpkit[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def resumes(run: Run) -> list[tuple[int, int, int | None]]:
    """``(step, world_size, world size that saved the checkpoint)`` for every start of ``run``
    that resumed from a checkpoint, in order."""
    out, previous = [], None
    for start in run.starts():
        world = start.get("world_size")
        if start.get("resumed_from") is not None:
            saved = start.get("saved_world_size") or previous
            out.append((int(start["resumed_from"]), world, saved))
        previous = world
    return out


def _label(run: Run, index: int, names: list[str] | None) -> str:
    if names and index < len(names):
        return names[index]
    return run.name or str(run.path)


def plot_runs(
    runs: list[Run], out: str | Path, names: list[str] | None = None, title: str | None = None
) -> Path:
    """Draw ``runs`` into ``out`` (PNG). Returns the path written."""
    if not runs:
        raise ValueError("no runs to plot")
    empty = [str(run.path) for run in runs if not run.steps]
    if empty:
        raise ValueError(f"{', '.join(empty)} holds no step records yet")
    plt = _pyplot()
    fig, (ax_loss, ax_lr, ax_stall) = plt.subplots(
        3, 1, figsize=(10, 8.5), sharex=True, gridspec_kw={"height_ratios": [3, 1, 1.3]}
    )
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        color, style = colors[i % len(colors)], _STYLES[i % len(_STYLES)]
        label = _label(run, i, names)
        steps = sorted(run.steps)
        loss = [run.steps[s]["loss"] for s in steps]
        ax_loss.plot(steps, loss, style, color=color, label=label, linewidth=1.6, zorder=3 + i)
        saves = run.saves()
        for kind, (marker, filled) in _MARKERS.items():
            marked = [s for s in saves if s in run.steps and _kind(saves[s]) == kind]
            if marked:
                ax_loss.scatter(
                    marked,
                    [run.steps[s]["loss"] for s in marked],
                    marker=marker,
                    s=46,
                    facecolors=color if filled else "white",
                    edgecolors=color,
                    zorder=10 + i,
                )
        for step, world, previous in resumes(run):
            ax_loss.axvline(step + 0.5, color=color, linestyle=":", linewidth=1.2, zorder=1)
            change = f"{previous} \u2192 {world}" if previous and previous != world else f"{world}"
            ax_loss.annotate(
                f"{label}: resumed after step {step}, {change} rank{'s' if world != 1 else ''}",
                xy=(step + 0.5, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(4, -14 - 13 * i),
                textcoords="offset points",
                fontsize=8,
                color=color,
            )
        ax_lr.plot(steps, [run.steps[s]["lr"] for s in steps], style, color=color, label=label)
        stall = [run.steps[s].get("checkpoint_stall_s") or 0.0 for s in steps]
        offset = (i - (len(runs) - 1) / 2) * width
        ax_stall.bar([s + offset for s in steps], stall, width=width, color=color, label=label)
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    handles, _ = ax_loss.get_legend_handles_labels()
    kinds = {_kind(e) for run in runs for e in run.saves().values()}
    handles += [
        Line2D(
            [],
            [],
            marker=marker,
            linestyle="",
            color="gray",
            markerfacecolor="gray" if filled else "white",
            label=f"{kind} checkpoint",
        )
        for kind, (marker, filled) in _MARKERS.items()
        if kind in kinds
    ]
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(handles=handles, fontsize=8, loc="lower left")
    ax_stall.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_loss.set_title(title or "training loss (markers: checkpoints; dotted: resumes)")
    ax_lr.set_ylabel("learning rate")
    ax_lr.grid(alpha=0.3)
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax_stall.set_ylabel("checkpoint\nstall (s)")
    ax_stall.set_xlabel("step")
    ax_stall.grid(alpha=0.3, axis="y")
    if len(runs) > 1:
        ax_stall.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_paths(paths: list[str | Path], out: str | Path, names: list[str] | None = None) -> Path:
    """``dcpkit plot``: read each run folder's metrics and draw them into ``out``."""
    return plot_runs([read_run(p) for p in paths], out, names=names)


def command(args: Any) -> int:
    """``dcpkit plot``."""
    print(plot_paths(args.runs, args.output, names=args.names))
    return 0
