"""``dcpkit report``: one self-contained HTML page about a run.

The page needs no network to be viewed: the plot is embedded as a PNG data URI and the styles are
inline. It shows the loss / lr / stall plot (with other runs overlaid when given), a summary,
every checkpoint of the run's checkpoint folder with its status (checksums verified unless asked
not to), every save with its mode and stall, and the run's configuration.
"""

from __future__ import annotations

import base64
import html
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from dcpkit.runlog import Run, read_run
from dcpkit.tools.plot import plot_runs, resumes
from dcpkit.units import human_bytes

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 9px; text-align: left; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bad { color: #b00020; font-weight: 600; } .good { color: #1b5e20; }
img.plot { width: 100%; max-width: 1100px; border: 1px solid #eee; }
.grid { display: flex; flex-wrap: wrap; gap: 1.5em; } .grid > div { flex: 1 1 320px; }
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(headers: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    head = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{cell}</td>' if i in numeric else f"<td>{cell}</td>"
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _summary(run: Run) -> list[list[Any]]:
    steps = sorted(run.steps)
    last = run.steps[steps[-1]]
    saves = run.saves()
    rows = [
        ["steps recorded", f"{steps[0]} \u2013 {steps[-1]} ({len(steps)})"],
        ["final loss", f"{last['loss']:.6f}"],
        ["tokens seen", f"{last.get('tokens_seen', 0):,}"],
        ["world sizes", ", ".join(str(s.get("world_size")) for s in run.starts()) or "-"],
        [
            "resumes",
            "; ".join(
                f"after step {step} on {world} rank(s)"
                + (f" (saved on {prev})" if prev and prev != world else "")
                for step, world, prev in resumes(run)
            )
            or "none",
        ],
        ["checkpoints saved", str(len(saves))],
    ]
    edges = _edge_saves(run)
    for mode in sorted({e["mode"] for e in saves.values()}):
        steady = [_stall(run, s) for s, e in saves.items() if e["mode"] == mode and s not in edges]
        left = sorted(s for s, e in saves.items() if e["mode"] == mode and s in edges)
        text = (
            f"median {statistics.median(steady):.3f}s, max {max(steady):.3f}s over {len(steady)}"
            if steady
            else "no save but a process's first"
        )
        if left:
            text += (
                f"; left out: the saves at steps {', '.join(map(str, left))} (a process's first, "
                "which allocates its buffers)"
            )
        rows.append([f"stall per save ({mode}; the save's step and the next)", text])
    times = [run.steps[s]["step_time_s"] for s in steps if "step_time_s" in run.steps[s]]
    if times:
        rows.append(["step time", f"median {statistics.median(times):.3f}s"])
    return [[_e(k), _e(v)] for k, v in rows]


def _stall(run: Run, step: int) -> float:
    """What a save blocked: its own step's stall and the next step's (which, after an
    asynchronous save, waits for the memory copy before the optimizer step)."""
    return run.saves()[step]["stall_s"] + run.steps.get(step + 1, {}).get("checkpoint_stall_s", 0.0)


def _edge_saves(run: Run) -> set[int]:
    """Steps of each process's first save: it allocates its buffers and plans its layout, so it
    is left out of the medians, as the demo's summary leaves it out."""
    firsts: set[int] = set()
    first: int | None = None
    started = False
    for event in run.events:
        if event.get("event") == "start":
            started, first = True, None
        elif event.get("event") == "save" and started and first is None:
            first = event["step"]
            firsts.add(first)
    return firsts


def _checkpoints(run: Run, verify: bool) -> str:
    from dcpkit.tools.listing import list_checkpoints

    folder = run.config().get("checkpoint", {}).get("folder", "checkpoint")
    location = folder if "://" in folder else str(run.path.parent / folder)
    try:
        listing = list_checkpoints(location, checksums=verify)
    except Exception as e:  # the page still renders; the reason is shown in its place
        return f'<p class="bad">{_e(location)}: {_e(e)}</p>'
    if not listing.entries:
        return f"<p>{_e(listing.root)}: no checkpoints</p>"
    rows = []
    for entry in listing.entries:
        corrupt = entry.status.startswith("CORRUPT")
        if not entry.published:
            checked = "-"
        elif corrupt:
            checked = '<span class="bad">failed</span>'
        else:
            what = "checksums, sizes, structure" if verify else "sizes, structure"
            checked = f'<span class="good">ok</span> ({what})'
        status = f'<span class="bad">{_e(entry.status)}</span>' if corrupt else _e(entry.status)
        rows.append(
            [
                _e(entry.name),
                _e("" if entry.step is None else entry.step),
                _e(human_bytes(entry.size)),
                status,
                checked,
            ]
        )
    return f"<p>{_e(listing.root)}</p>" + _table(
        ["checkpoint", "step", "size", "status", "verified"], rows, numeric={1, 2}
    )


def _saves(run: Run) -> str:
    saves = run.saves()
    if not saves:
        return "<p>no checkpoint was saved</p>"
    rows = [
        [
            _e(step),
            _e(event["mode"] + (" (model only)" if event.get("model_only") else "")),
            _e(f"{event['stall_s']:.3f}"),
            _e(f"{1000 * run.steps.get(step + 1, {}).get('checkpoint_stall_s', 0.0):.1f}"),
        ]
        for step, event in sorted(saves.items())
    ]
    return _table(
        ["step", "mode", "stall at the save (s)", "stall at the next step (ms)"],
        rows,
        numeric={0, 2, 3},
    )


def _config(run: Run) -> str:
    config = run.config()
    if not config:
        return "<p>no configuration recorded</p>"
    blocks = []
    for section, options in config.items():
        rows = [[_e(k), _e(v)] for k, v in options.items()]
        blocks.append(f"<div><h3>[{_e(section)}]</h3>{_table(['option', 'value'], rows)}</div>")
    return f'<div class="grid">{"".join(blocks)}</div>'


def render_report(
    run_path: str | Path,
    out: str | Path,
    compare: list[str | Path] = (),
    verify: bool = True,
) -> Path:
    """Write the report of the run at ``run_path`` (its dump folder) to ``out``; ``compare``:
    other runs drawn on the same plot."""
    run = read_run(run_path)
    others = [read_run(p) for p in compare]
    if not run.steps:
        raise ValueError(f"{run.path} holds no step records yet")
    with tempfile.TemporaryDirectory() as tmp:
        png = plot_runs([run, *others], Path(tmp) / "plot.png")
        data = base64.b64encode(png.read_bytes()).decode()
    description = run.config().get("job", {}).get("description", "")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>dcpkit report: {_e(run.name)}</title><style>{_CSS}</style></head>
<body>
<h1>dcpkit run report: {_e(run.name)}</h1>
<p class="sub">{_e(description)} &middot; {_e(run.path)} &middot; generated
{_e(time.strftime("%Y-%m-%d %H:%M:%S"))}</p>
<h2>Loss, learning rate and checkpoint stall</h2>
<img class="plot" id="plot" alt="loss, learning rate and checkpoint stall per step"
 src="data:image/png;base64,{data}">
<h2>Summary</h2>
{_table(["", ""], _summary(run))}
<h2>Checkpoints</h2>
{_checkpoints(run, verify)}
<h2>Saves</h2>
{_saves(run)}
<h2>Configuration</h2>
{_config(run)}
</body></html>
"""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    return out


def command(args: Any) -> int:
    """``dcpkit report``."""
    print(render_report(args.run, args.output, compare=args.compare, verify=not args.quick))
    return 0
