"""The throughput plot the IO benchmarks write next to their JSON: each operation's GiB/s against
the size of the checkpoint, beside the raw IO of the same bytes measured in the same run."""

from __future__ import annotations

from pathlib import Path

Series = tuple[str, list[tuple[float, float]]]
"""A label and its points: (size in GiB, GiB/s)."""


def throughput_png(
    png: Path, title: str, panels: dict[str, list[tuple[Series, Series | None]]]
) -> None:
    """One panel per entry of ``panels`` (a world size, say), each a list of (operation, its raw
    baseline) pairs: the operation a solid line, its baseline a dashed line of the same colour
    (None: drawn with another operation's)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.4 * len(panels), 4.6), squeeze=False, sharey=True
    )
    for ax, (name, pairs) in zip(axes[0], panels.items()):
        sizes = sorted({x for op, _ in pairs for x, _ in op[1]})
        for i, (op, base) in enumerate(pairs):
            for series, style in ((op, "-o"), (base, "--s")):
                if series is None:
                    continue
                label, pts = series[0], sorted(series[1])
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, color=f"C{i}", label=label)
        if len(sizes) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{x:.3g}" for x in sizes])
        ys = [y for op, base in pairs for series in (op, base) if series for _, y in series[1]]
        if max(ys) > 8 * min(ys):  # a warm read beside a disk write: both readable
            ax.set_yscale("log", base=2)
            ax.yaxis.set_major_formatter(ScalarFormatter())
        else:
            ax.set_ylim(bottom=0)
        ax.minorticks_off()
        ax.set_xlabel("checkpoint size (GiB)")
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("GiB/s (dashed: raw IO of the same bytes)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
