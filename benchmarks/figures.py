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

# this script's folder is on sys.path: the renderers of the larger pages are beside it
from _figures_io import io_speed, io_speed_small, recovery
from _figures_push import rl_loop, weight_push
from _figures_scale import (
    metadata_verify,
    planning,
    planning_first_save,
    planning_index,
    planning_parse,
    planning_replicas,
    planning_restart,
)
from _figures_suite import test_profile
from _format import GIB, MIB, head, para, span, times

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- figures: (\w+) -->\n)(.*?)(<!-- /figures -->)", re.S)


@dataclass(frozen=True)
class Source:
    results: str  # the results file, relative to the repository
    script: str  # the benchmark that writes it
    render: Callable[[dict], str]


def trainer_stall(data: dict) -> str:
    names = {"trainer": "the `Trainer`'s own save"}
    saves = len(next(iter(data["results"].values()))["stalls_s"])
    opts, ours = data["options"], data["results"]["disabled"]
    written = opts["steps"] // opts["every"]  # the run's folder keeps every save
    lines = [
        para(
            f"The model: {ours['params'] / 1e6:.0f} M parameters, a checkpoint of "
            f"{ours['bytes_on_disk'] / written / GIB:.2f} GiB with AdamW's state; "
            f"{opts['steps']} steps, a save every {opts['every']}."
        ).rstrip("\n"),
        "",
    ]
    lines += head(
        "save", f"stall per save (median of {saves})", "a step without a save", "the whole run"
    )
    for mode, r in data["results"].items():
        name = names.get(mode, f"dcpkit `{mode}`")
        lines.append(
            f"| {name} | {r['stall_s']:.2f} s | {r['step_s']:.2f} s | {r['total_s']:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def lightning_stall(data: dict) -> str:
    names = {"lightning": "Lightning's own `ModelParallelStrategy` (DCP, synchronous)"}
    saves = len(next(iter(data["results"].values()))["stalls_s"])
    opts, ours = data["options"], data["results"]["disabled"]
    written = opts["steps"] // opts["every"]  # every save kept
    lines = [
        para(
            f"The model: {ours['params'] / 1e6:.0f} M parameters, FSDP2 over 2 processes, a "
            f"checkpoint of {ours['bytes_on_disk'] / written / GIB:.2f} GiB with AdamW's state; "
            f"{opts['steps']} batches, a save every {opts['every']}."
        ).rstrip("\n"),
        "",
    ]
    lines += head(
        "save",
        f"stall per save (median of {saves})",
        "of which in the strategy's save",
        "a batch without a save",
        "the whole run",
    )
    for mode, r in data["results"].items():
        name = names.get(mode, f"dcpkit `{mode}`")
        lines.append(
            f"| {name} | {r['stall_s']:.2f} s | {r['save_call_s']:.2f} s | {r['step_s']:.2f} s "
            f"| {r['total_s']:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def frozen_base(data: dict) -> str:
    opts, linked = data["options"], data["results"]["linked"]
    lines = [
        para(
            f"The model: {linked['params'] / 1e6:.1f} M parameters, of which "
            f"{linked['trainable_params'] / 1e6:.2f} M train (LoRA r={opts['rank']}); the frozen "
            f"base {linked['frozen_bytes'] / MIB:.1f} MiB, the trainable state (adapters and "
            f"AdamW's moments) {linked['trainable_state_bytes'] / MIB:.2f} MiB; "
            f"{opts['saves']} saves, the later ones' medians."
        ).rstrip("\n"),
        "",
    ]
    lines += head(
        "frozen base", "first save", "each later save", "x the trainable state", "save time"
    )
    names = {"linked": "`link_frozen = true`: written once", "written": "`false`: at every save"}
    for name, r in data["results"].items():
        ratio = r["save_bytes"] / r["trainable_state_bytes"]
        lines.append(
            f"| {names[name]} | {r['first_save_bytes'] / MIB:.2f} MiB | "
            f"{r['save_bytes'] / MIB:.2f} MiB | {ratio:.2f}x | {r['save_s']:.3f} s |"
        )
    return "\n".join(lines) + "\n"


def readers_beside(data: dict) -> str:
    names = {
        "alone": "no reader",
        "holding": "a reader holding the newest step, one after another",
        "evaluating": "the evaluation job: verify, `to-hf`, `from_pretrained`, 100 batches",
    }
    lines = head(
        f"beside the run ({data['steps']} steps, {data['mode']})",
        "stall per save",
        "vs alone",
        "reads",
        "of them, read after retention's turn",
        "losses as alone",
    )
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


def s3_transfer(data: dict) -> str:
    rows = data["rows"]
    lines = head(
        "ranks",
        "GiB",
        "op",
        "dcpkit",
        "raw (boto3)",
        "s3torchconnector",
        "dcpkit / raw",
        "dcpkit / s3torchconnector",
    )
    for r in rows:
        for op in ("save", "load"):
            cells = " | ".join(f"{r[f'{who}_{op}_s']:.2f} s" for who in ("dcpkit", "raw", "s3tc"))
            lines.append(
                f"| {r['ranks']} | {r['gib']:.2f} | {op} | {cells} | {r[f'{op}_vs_raw']:.2f}x "
                f"| {r[f'{op}_vs_s3tc']:.2f}x |"
            )
    peaks = ", ".join(f"{r['load_peak_over_mib']:.0f} MiB at {r['ranks']} rank(s)" for r in rows)
    upload = ", ".join(f"{r['gib'] / r['raw_save_s']:.2f}" for r in rows)
    lines += [
        "",
        f"(x: dcpkit's speed over the other's; medians of {data['repeats']}, {data['cpus']} CPUs.) "
        f"A load's peak resident\nmemory above the process's before it: {peaks} (sampled every "
        f"2 ms), against the stated\nbound of parts in flight ({data['parts_in_flight_mib']:.0f} "
        f"MiB). The raw upload ran at {upload} GiB/s.",
    ]
    return "\n".join(lines) + "\n"


def s3_transfer_summary(data: dict) -> str:
    rows = data["rows"]
    lines = [
        f"{rows[0]['gib']:.2f} GiB of model + AdamW saved to and loaded from SeaweedFS (a real S3 "
        "server, loopback) in\none run of `benchmarks/s3_transfer.py` (median of "
        f"{data['repeats']}, slowest rank; a load verifies checksums):",
        "",
        *head("ranks", "op", "dcpkit", "raw boto3 transfer", "s3torchconnector"),
    ]
    for r in rows:
        for op in ("save", "load"):
            lines.append(
                f"| {r['ranks']} | {op} | {r[f'dcpkit_{op}_s']:.2f} s | {r[f'raw_{op}_s']:.2f} s "
                f"({r[f'{op}_vs_raw']:.2f}x) | {r[f's3tc_{op}_s']:.2f} s "
                f"({r[f'{op}_vs_s3tc']:.2f}x) |"
            )
    spans = {
        (who, op): span([r[f"{op}_vs_{who}"] for r in rows])
        for who in ("raw", "s3tc")
        for op in ("save", "load")
    }
    peak = max(r["load_peak_over_mib"] for r in rows)
    lines += [
        "",
        f"x: dcpkit's speed over the other's: {spans['raw', 'save']} a raw transfer to save and "
        f"{spans['raw', 'load']} to load;\n{spans['s3tc', 'save']} and {spans['s3tc', 'load']} "
        f"s3torchconnector. A load stays within {data['parts_in_flight_mib']:.0f} MiB of parts in "
        f"flight ({peak:.0f} MiB\nmeasured at most).",
    ]
    return "\n".join(lines) + "\n"


ASYNC_NAMES = {
    "disabled": "`disabled` (sync)",
    "async": "`async`",
    "async_with_pinned_mem": "`async_with_pinned_mem`",
    "torch_async_save": "PyTorch `dcp.async_save`, default stager",
}


def async_stall(data: dict) -> str:
    results, floor = data["results"], data["floor_s"]
    gib = next(iter(results.values()))["state_bytes"] / GIB
    lines = [
        f"One run on {data['cpus']} CPUs, {gib:.2f} GiB of model + AdamW state, medians of saves "
        f"3-{data['saves']}:",
        "",
        *head(
            "mode",
            "blocked per save",
            f"x copy floor ({floor:.3f} s)",
            "x sync save",
            "durable after",
            f"RSS growth, save 2 -> {data['saves']}",
        ),
    ]
    for mode, r in results.items():
        lines.append(
            f"| {ASYNC_NAMES[mode]} | {r['blocked_median_s']:.3f} s | {r['x_floor']:.2f} "
            f"| {r['x_sync']:.3f} | {r['durable_median_s']:.3f} s "
            f"| {r['rss_growth_after_second_save'] / MIB:.1f} MiB |"
        )
    sync = results["disabled"]
    save = sync["checkpoint_bytes"] / GIB / sync["durable_median_s"]
    raw = sync["raw_bytes"] / GIB / sync["raw_write_fsync_s"]
    lines += [
        "",
        f"Same run: a sync save wrote {save:.2f} GiB/s, a raw write + fsync of the same bytes "
        f"{raw:.2f} GiB/s.",
    ]
    return "\n".join(lines) + "\n"


def async_pressure(data: dict) -> str:
    pressure = data["pressure"]
    alone = sorted(r["compute_alone_s"] for r in pressure.values())[len(pressure) // 2]
    lines = head(
        "mode",
        f"compute between saves (alone: {alone:.2f} s)",
        "blocked per save",
        "forced by the disk",
        "x PyTorch",
    )
    for mode, r in pressure.items():
        name = ASYNC_NAMES[mode].split(",")[0]
        lines.append(
            f"| {name} | {r['compute_median_s']:.3f} s | {r['blocked_median_s']:.3f} s "
            f"| {r['forced_s']:.3f} s | {r['x_torch']:.2f} |"
        )
    slower = [r["compute_median_s"] / r["compute_alone_s"] for r in pressure.values()]
    lines += ["", f"The compute between saves ran {span(slower)} its time alone."]
    return "\n".join(lines) + "\n"


def async_stall_summary(data: dict) -> str:
    results = data["results"]
    gib = next(iter(results.values()))["state_bytes"] / GIB
    blocked = {mode: f"{r['blocked_median_s']:.3f} s" for mode, r in results.items()}
    return (
        f"{gib:.2f} GiB of model + AdamW, the blocked time per save in one run of\n"
        f"`benchmarks/async_stall.py` (medians of saves 3-{data['saves']}): synchronous "
        f"{blocked['disabled']}, `async`\n{blocked['async']}, `async_with_pinned_mem` "
        f"{blocked['async_with_pinned_mem']}, PyTorch's own `dcp.async_save`\n"
        f"{blocked['torch_async_save']}, against a plain copy of the same state into memory at "
        f"{data['floor_s']:.3f} s.\n"
    )


def train_cost(data: dict) -> str:
    step, floor = data["baseline_step_s"], data["copy_floor_s"]
    lines = head(
        "mode",
        "true cost per save (step-time delta)",
        f"x a step ({step:.3f} s)",
        "blocked per save (`checkpoint_stall_s`)",
        f"x copy floor ({floor:.4f} s)",
    )
    for mode, r in data["results"].items():
        lines.append(
            f"| {ASYNC_NAMES[mode]} | {r['true_cost_per_save_s']:.3f} s "
            f"| {r['true_cost_per_save_s'] / step:.2f} | {r['blocked_per_save_s']:.4f} s "
            f"| {times(r['blocked_x_copy_floor'])} |"
        )
    results = data["results"]
    if "disabled" in results:
        sync = results["disabled"]
        others = [r for m, r in results.items() if m != "disabled"]
        blocked = span([r["blocked_per_save_s"] / sync["blocked_per_save_s"] for r in others])
        cost = span([r["true_cost_per_save_s"] / sync["true_cost_per_save_s"] for r in others])
        lines += [
            "",
            f"{data['saves']} saves, {data['state_bytes_per_rank'] / MIB:.0f} MiB of state per "
            f"rank; an async save blocked {blocked} as long as a\nsynchronous one, and cost "
            f"the run {cost} as much.",
        ]
    return "\n".join(lines) + "\n"


CONVERT_NAMES = {
    "raw read+write": "raw read+write of the same bytes",
    "dcpkit to-torch": "`dcpkit to-torch`",
    "dcpkit to-hf": "`dcpkit to-hf`",
    "dcpkit from-hf": "`dcpkit from-hf`",
    "torch dcp_to_torch_save": "PyTorch `dcp_to_torch_save`",
}


def convert(data: dict) -> str:
    sizes = data["sizes"]
    lines = head(
        "operation", *(f"{d['checkpoint_bytes'] / GIB:.2f} GiB: s (x raw), peak RSS" for d in sizes)
    )
    for op, name in CONVERT_NAMES.items():
        cells = []
        for d in sizes:
            r = d["results"].get(op)
            cells.append(
                f"skipped: {d['skipped'][op]}"
                if r is None
                else f"{r['wall_s']:.2f} ({r['wall_vs_raw']:.2f}x), "
                f"{r['rss_above_baseline_bytes'] / MIB:.0f} MiB"
            )
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def convert_model(data: dict) -> str:
    (d,) = data["sizes"]
    lines = head(
        f"Llama 3 {data['flavor']}, {d['dtype']}, {d['checkpoint_bytes'] / GIB:.2f} GiB",
        "wall s",
        "x raw read+write",
        "peak RSS above baseline",
    )
    for op, name in CONVERT_NAMES.items():
        r = d["results"].get(op)
        if r is not None:
            lines.append(
                f"| {name} | {r['wall_s']:.2f} | {r['wall_vs_raw']:.2f} "
                f"| {r['rss_above_baseline_bytes'] / MIB:.0f} MiB |"
            )
    for op, why in d["skipped"].items():
        lines += ["", f"{CONVERT_NAMES[op]} is not run at this size: it {why}."]
    return "\n".join(lines) + "\n"


def moe_convert(data: dict) -> str:
    names = {
        "raw read+write": "raw read+write of the checkpoint's bytes",
        "dcpkit to-hf": "`dcpkit to-hf` (stacked -> one tensor per expert)",
        "dcpkit from-hf": "`dcpkit from-hf` (per expert -> stacked)",
        "dcpkit from-hf (FP8 source)": "`dcpkit from-hf` from FP8, dequantized to bf16",
    }
    bound = data["rss_bound_bytes"] / MIB
    lines = [
        f"{data['args']['experts']} experts, {data['checkpoint_bytes'] / GIB:.2f} GiB in bfloat16; "
        f"the FP8 folder {data['fp8_folder_bytes'] / GIB:.2f} GiB; the largest\nstacked expert "
        f"tensor {data['largest_stacked_expert_bytes'] / MIB:.0f} MiB:",
        "",
        *head(
            "operation",
            "wall s",
            "x raw read+write",
            "peak RSS above baseline",
            "bound: largest stacked expert + 256 MiB",
        ),
    ]
    for op, name in names.items():
        r = data["results"][op]
        cell = "" if op == "raw read+write" else f"{bound:.0f} MiB"
        lines.append(
            f"| {name} | {r['wall_s']:.2f} | {r['wall_vs_raw']:.2f} "
            f"| {r['rss_above_baseline_bytes'] / MIB:.0f} MiB | {cell} |"
        )
    return "\n".join(lines) + "\n"


def model_io(data: dict) -> str:
    gib = data["checkpoint_bytes"] / GIB
    runs = data["runs"]
    lines = head(
        f"Llama 3 {data['flavor']}, {data['dtype']}, {gib:.2f} GiB",
        *(cell for n in runs for cell in (f"{n} rank(s): s", "GiB/s", "x raw")),
    )
    rows = [
        ("load, page cache dropped", "load_s", "raw_read_s"),
        ("raw parallel read of the same files", "raw_read_s", None),
        ("sync save (durable, published)", "save_s", "raw_write_fsync_s"),
        ("raw write + fsync of the same bytes", "raw_write_fsync_s", None),
    ]
    for name, key, base in rows:
        cells = []
        for run in runs.values():
            t = run["slowest"][key]
            x = f"{run['slowest'][base] / t:.2f}" if base else ""
            cells.append(f"{t:.2f} | {gib / t:.2f} | {x}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    load = [run["slowest"]["load_peak_above_model"] / MIB for run in runs.values()]
    save = [run["slowest"]["save_peak_above_model"] / MIB for run in runs.values()]
    lines += [
        "",
        f"Medians of {data['reps']}. Peak memory above the model's own: {min(load):.0f}-"
        f"{max(load):.0f} MiB for a load (each stored\nchunk is read into the parameter it "
        f"belongs to) and {min(save):.0f}-{max(save):.0f} MiB for a save.",
    ]
    return "\n".join(lines) + "\n"


SOURCES: dict[str, Source] = {
    "test_profile": Source(
        "benchmarks/results/test_profile.json", "benchmarks/test_profile.py", test_profile
    ),
    "readers_beside": Source(
        "benchmarks/results/readers_beside.json", "benchmarks/readers_beside.py", readers_beside
    ),
    "trainer_stall": Source(
        "benchmarks/results/trainer_stall.json", "benchmarks/trainer_stall.py", trainer_stall
    ),
    "weight_push": Source(
        "benchmarks/results/weight_push.json", "benchmarks/weight_push.py", weight_push
    ),
    "rl_loop": Source("benchmarks/results/rl_loop.json", "examples/rl_loop.py", rl_loop),
    "frozen_base": Source(
        "benchmarks/results/frozen_base.json", "benchmarks/frozen_base.py", frozen_base
    ),
    "lightning_stall": Source(
        "benchmarks/results/lightning_stall.json", "benchmarks/lightning_stall.py", lightning_stall
    ),
    "async_stall": Source(
        "benchmarks/results/async_stall.json", "benchmarks/async_stall.py", async_stall
    ),
    "async_pressure": Source(
        "benchmarks/results/async_stall.json", "benchmarks/async_stall.py", async_pressure
    ),
    "async_stall_summary": Source(
        "benchmarks/results/async_stall.json", "benchmarks/async_stall.py", async_stall_summary
    ),
    "train_cost": Source(
        "benchmarks/results/train_cost.json", "benchmarks/train_cost.py", train_cost
    ),
    "train_cost_200m": Source(
        "benchmarks/results/train_cost_200m.json", "benchmarks/train_cost.py", train_cost
    ),
    "convert": Source("benchmarks/results/convert.json", "benchmarks/convert.py", convert),
    "convert_8b": Source(
        "benchmarks/results/convert_8b.json", "benchmarks/convert.py", convert_model
    ),
    "moe_convert": Source(
        "benchmarks/results/moe_convert.json", "benchmarks/moe_convert.py", moe_convert
    ),
    "model_io": Source("benchmarks/results/model_io.json", "benchmarks/model_io.py", model_io),
    "s3_transfer": Source(
        "benchmarks/results/s3_transfer.json", "benchmarks/s3_transfer.py", s3_transfer
    ),
    "s3_transfer_summary": Source(
        "benchmarks/results/s3_transfer.json", "benchmarks/s3_transfer.py", s3_transfer_summary
    ),
    "io_speed": Source("benchmarks/results/io_speed.json", "benchmarks/io_speed.py", io_speed),
    "io_speed_small": Source(
        "benchmarks/results/io_speed_small.json", "benchmarks/io_speed.py", io_speed_small
    ),
    "recovery": Source("benchmarks/results/recovery.json", "benchmarks/recovery.py", recovery),
    "planning": Source(
        "benchmarks/results/planning_scale.json", "benchmarks/planning_scale.py", planning
    ),
    "planning_parse": Source(
        "benchmarks/results/planning_scale.json", "benchmarks/planning_scale.py", planning_parse
    ),
    "planning_index": Source(
        "benchmarks/results/planning_scale.json", "benchmarks/planning_scale.py", planning_index
    ),
    "planning_restart": Source(
        "benchmarks/results/planning_scale.json", "benchmarks/planning_scale.py", planning_restart
    ),
    "planning_first_save": Source(
        "benchmarks/results/planning_scale.json",
        "benchmarks/planning_scale.py",
        planning_first_save,
    ),
    "planning_replicas": Source(
        "benchmarks/results/planning_scale.json", "benchmarks/planning_scale.py", planning_replicas
    ),
    "metadata_verify": Source(
        "benchmarks/results/planning_scale_verify.json",
        "benchmarks/planning_scale.py",
        metadata_verify,
    ),
}


def render(name: str) -> str:
    source = SOURCES[name]
    path = ROOT / source.results
    if not path.is_file():
        raise FileNotFoundError(
            f"figures block {name!r}: its results file {source.results} is missing "
            f"(written by {source.script} with --json)"
        )
    return source.render(json.loads(path.read_text()))


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
        try:
            want = render(name)
        except FileNotFoundError as e:
            problems.append(f"{where}: {e}")
            continue
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
        try:
            new = BLOCK.sub(lambda m: m.group(1) + render(m.group(2)) + m.group(4), text)
        except FileNotFoundError as e:
            print(f"{where}: {e}", file=sys.stderr)
            return 1
        if new != text:
            page.write_text(new)
            print(f"figures: {where} updated")
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
