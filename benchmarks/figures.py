"""Benchmark figures in README.md and docs/*.md, generated from the results files the
benchmarks write (``benchmarks/results/*.json``): one source for each figure.

    python benchmarks/figures.py           # rewrite every marked block from its results file
    python benchmarks/figures.py --check   # exit 1, naming the block, when one differs

A block is marked in the Markdown by the two comments around it (invisible on the site and on
GitHub)::

    <!-- figures: trainer_stall -->
    | ... |
    <!-- /figures -->

The name picks an entry of ``SOURCES``: the results file, the script that writes it, and the
function that renders the block from it. ``make docs`` runs this before building the site; the
test suite runs ``--check``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- figures: (\w+) -->\n)(.*?)(<!-- /figures -->)", re.S)
GIB, MIB = 1 << 30, 1 << 20


@dataclass(frozen=True)
class Source:
    results: str  # the results file, relative to the repository
    script: str  # the benchmark that writes it
    render: Callable[[dict], str]


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def trainer_stall(data: dict) -> str:
    names = {"trainer": "the `Trainer`'s own save"}
    saves = len(next(iter(data["results"].values()))["stalls_s"])
    lines = [
        f"| save | stall per save (median of {saves}) | a step without a save | the whole run |",
        "| --- | --- | --- | --- |",
    ]
    for mode, r in data["results"].items():
        name = names.get(mode, f"dcpkit `{mode}`")
        lines.append(
            f"| {name} | {r['stall_s']:.2f} s | {r['step_s']:.2f} s | {r['total_s']:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def metadata_verify(data: dict) -> str:
    rows = {r["world"]: r for r in data["rows"]}
    small = rows[min(rows)]
    whole_per_chunk = (small["verify_whole_peak_bytes"] - small["verify_start_bytes"]) / small[
        "verify_chunks"
    ]
    lines = [
        "| 405B, ranks | chunks | `.metadata` | arrays | reading and checks in arrays "
        "| the same on DCP's objects |",
        "|---|---|---|---|---|---|",
    ]
    per_chunk = []
    for world, r in sorted(rows.items()):
        arrays = f"{r['verify_s']:.0f} s, peak {r['verify_peak_bytes'] / GIB:.2f} GiB"
        if "verify_whole_s" in r:
            whole = (
                f"{r['verify_whole_s']:.0f} s, peak {r['verify_whole_peak_bytes'] / GIB:.2f} GiB"
            )
        else:
            guess = whole_per_chunk * r["verify_chunks"] / GIB
            whole = f"(about {guess:.0f} GiB above the start, extrapolated)"
        lines.append(
            f"| {world} | {r['verify_chunks'] / 1e6:.3g} M | {_size(r['described_metadata_bytes'])}"
            f" | {_size(r['verify_arrays_bytes'])} | {arrays} | {whole} |"
        )
        per_chunk.append(
            (world, (r["verify_peak_bytes"] - r["verify_start_bytes"]) / r["verify_chunks"])
        )
    (w1, b1), (w2, b2) = per_chunk[0], per_chunk[-1]
    ratio = small["verify_s"] / small["verify_whole_s"]
    lines += [
        "",
        f"In arrays the peak above the process's start is {b1:.0f} bytes a chunk at {w1} ranks "
        f"and {b2:.0f} at\n{w2}, against {whole_per_chunk:.0f} with DCP's objects; the time is "
        f"{ratio:.2f}x theirs (each tensor's entry is built\nonce per check that asks for it).",
    ]
    return "\n".join(lines) + "\n"


def readers_beside(data: dict) -> str:
    names = {
        "alone": "no reader",
        "holding": "a reader holding the newest step, one after another",
        "evaluating": "the evaluation job: verify, `to-hf`, `from_pretrained`, 100 batches",
    }
    lines = [
        f"| beside the run ({data['steps']} steps, {data['mode']}) | stall per save | vs alone "
        "| reads | of them, read after retention's turn | losses as alone |",
        "|---|---|---|---|---|---|",
    ]
    for way, r in data["results"].items():
        reads, late = "-", "-"
        if way == "holding":
            reads = f"{r['holds']} holds"
        elif way == "evaluating":
            reads = f"{r['reads']}, {r['reads_verified']} verified"
            late = str(r["reads_outliving_retention"])
        same = "bitwise" if r["losses_equal_alone"] else "differ"
        lines.append(
            f"| {names[way]} | {r['stall_s'] * 1000:.0f} ms | {r['vs_alone']:.2f}x | {reads} "
            f"| {late} | {same} |"
        )
    left = sorted({", ".join(steps) for r in data["results"].values() for steps in r["left"]})
    lines += [
        "",
        f"Medians of {data['rounds']} rounds ({data['cpus']} CPUs); the steps left after each run: "
        f"{'; '.join(left)}.",
    ]
    return "\n".join(lines) + "\n"


SOURCES: dict[str, Source] = {
    "readers_beside": Source(
        "benchmarks/results/readers_beside.json", "benchmarks/readers_beside.py", readers_beside
    ),
    "trainer_stall": Source(
        "benchmarks/results/trainer_stall.json", "benchmarks/trainer_stall.py", trainer_stall
    ),
    "metadata_verify": Source(
        "benchmarks/results/planning_scale_verify.json",
        "benchmarks/planning_scale.py",
        metadata_verify,
    ),
}


def render(name: str) -> str:
    source = SOURCES[name]
    return source.render(json.loads((ROOT / source.results).read_text()))


def check_text(text: str, where: str) -> list[str]:
    """What differs between the marked blocks of ``text`` and their results files."""
    problems = []
    for m in BLOCK.finditer(text):
        name, shown = m.group(2), m.group(3)
        if name not in SOURCES:
            problems.append(
                f"{where}: figures block {name!r} has no source (benchmarks/figures.py)"
            )
            continue
        want = render(name)
        if shown != want:
            differ = next(
                (a, b)
                for a, b in zip([*shown.splitlines(), ""], [*want.splitlines(), ""])
                if a != b
            )
            problems.append(
                f"{where}: figures block {name!r} differs from {SOURCES[name].results}: the page "
                f"says {differ[0]!r} where the results give {differ[1]!r}"
            )
    return problems


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a block differs")
    opts = p.parse_args()
    problems = []
    for page in pages():
        text = page.read_text()
        where = str(page.relative_to(ROOT))
        if opts.check:
            problems += check_text(text, where)
            continue
        new = BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)
        if new != text:
            page.write_text(new)
            print(f"figures: {where} updated")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
