"""What a checkpoint really costs a training run: the reference trainer, timed step by step.

    python benchmarks/train_cost.py [--nproc 2] [--steps 40] [--interval 5] [--flavor NAME]
        [--batch N] [--seq-len N] [--json PATH]

One run of the reference trainer (torchrun, a Llama 3 flavor - debugmodel by default; 200M
has a step far longer than the copy of its state - and the repository's config) per
checkpoint mode: without checkpoints (the baseline, run first and last), then ``disabled``
(synchronous), ``async`` and ``async_with_pinned_mem``, ``--interval`` steps apart. From each
run's ``metrics.jsonl`` (steps from the first save on, the last step excluded: its save is
always synchronous):

- the true cost per checkpoint: the run's total step time minus the baseline's over the same
  steps, divided by the saves among them (it includes whatever a background writer takes from
  the training steps, not only the time they are blocked);
- the blocked time per save: ``checkpoint_stall_s`` of the saving step plus that of the next
  step (where ``maybe_wait_for_staging`` waits for the copy), median;
- the copy floor: one ``copy_`` of the rank's state (its share of a saved step's bytes) into a
  preallocated buffer, measured here; and the median step time, to show that a step takes
  longer than the copy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "llama3_debugmodel.toml"
MODES = ["disabled", "async", "async_with_pinned_mem"]


def train(dump: Path, opts: argparse.Namespace, mode: str | None) -> dict:
    from dcpkit.launch import torchrun_command
    from dcpkit.runlog import read_run

    steps, interval = opts.steps, opts.interval
    overrides = ["--training.steps", str(steps), "--metrics.log_freq", str(steps)]
    overrides += ["--model.flavor", opts.flavor]
    if opts.batch:
        overrides += ["--training.global_batch_size", str(opts.batch)]
    if opts.seq_len:
        overrides += ["--training.seq_len", str(opts.seq_len)]
    if mode is None:
        overrides += ["--checkpoint.enable", "false"]
    else:
        overrides += [
            "--checkpoint.interval",
            str(interval),
            "--checkpoint.async_mode",
            mode,
            "--checkpoint.keep_latest_k",
            "2",
        ]
    cmd = torchrun_command(
        opts.nproc, ["--job.config_file", str(CONFIG), "--job.dump_folder", str(dump), *overrides]
    )
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"training ({mode or 'no checkpoints'}) failed:\n{proc.stderr[-3000:]}")
    run = read_run(dump)
    ckpt = dump / "checkpoint"
    step_bytes = 0
    if ckpt.is_dir():
        last = max((p for p in ckpt.iterdir() if p.name.startswith("step-")), default=None)
        if last is not None:
            step_bytes = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    return {"steps": run.steps, "wall_s": wall, "step_bytes": step_bytes}


def copy_floor(nbytes: int) -> float:
    import torch

    src = torch.rand(max(1, nbytes // 4))
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--interval", type=int, default=5)
    parser.add_argument("--modes", default=",".join(MODES), help="checkpoint modes to run")
    parser.add_argument("--flavor", default="debugmodel", help="Llama 3 flavor")
    parser.add_argument("--batch", type=int, help="global batch size (default: the config's)")
    parser.add_argument("--seq-len", type=int, help="sequence length (default: the config's)")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: {m!r} is not one of {', '.join(MODES)}")
    if opts.steps < 3 * opts.interval:
        parser.error("--steps must allow at least 3 saves (>= 3 x --interval)")
    work = Path(tempfile.mkdtemp(prefix="dcpkit-cost-"))
    runs: dict[str, dict] = {}
    try:
        order = [("baseline", None), *((m, m) for m in modes), ("baseline_again", None)]
        for name, mode in order:
            runs[name] = train(work / name, opts, mode)
            print(f"  ran {name}: {runs[name]['wall_s']:.1f}s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first, last = opts.interval, opts.steps - 1
    window = range(first, last + 1)
    saves_in = [s for s in window if s % opts.interval == 0]
    base = {
        s: statistics.mean(
            runs[b]["steps"][s]["step_time_s"] for b in ("baseline", "baseline_again")
        )
        for s in window
    }
    base_total = sum(base.values())
    step_med = statistics.median(base.values())
    state_bytes = max(r["step_bytes"] for r in runs.values()) // opts.nproc
    floor = copy_floor(state_bytes)
    print(
        f"\nLlama 3 {opts.flavor}, {opts.nproc} ranks, a save every {opts.interval} steps; steps "
        f"{first}-{last} ({len(saves_in)} saves); state {state_bytes / 2**20:.1f} MiB per rank"
    )
    print(f"baseline step (no checkpoints), median: {step_med:.3f}s; copy floor {floor:.4f}s")
    print(
        f"\n{'mode':<24} {'true cost/save s':>17} {'x step':>7} {'blocked/save s':>15} "
        f"{'x copy floor':>13}"
    )
    results = {}
    for mode in modes:
        steps = runs[mode]["steps"]
        total = sum(steps[s]["step_time_s"] for s in window)
        cost = (total - base_total) / len(saves_in)
        blocked = statistics.median(
            steps[s]["checkpoint_stall_s"] + steps[s + 1]["checkpoint_stall_s"] for s in saves_in
        )
        results[mode] = {
            "true_cost_per_save_s": cost,
            "blocked_per_save_s": blocked,
            "blocked_x_copy_floor": blocked / floor,
            "saving_step_s": statistics.median(steps[s]["step_time_s"] for s in saves_in),
        }
        print(
            f"{mode:<24} {cost:>17.3f} {cost / step_med:>7.2f} {blocked:>15.4f} "
            f"{blocked / floor:>13.2f}"
        )
    if opts.json:
        opts.json.write_text(
            json.dumps(
                {
                    "command": " ".join(["python", "benchmarks/train_cost.py", *sys.argv[1:]]),
                    "saves": len(saves_in),
                    "nproc": opts.nproc,
                    "flavor": opts.flavor,
                    "interval": opts.interval,
                    "steps": opts.steps,
                    "state_bytes_per_rank": state_bytes,
                    "copy_floor_s": floor,
                    "baseline_step_s": step_med,
                    "results": results,
                    "step_times": {
                        n: {s: r["steps"][s]["step_time_s"] for s in window}
                        for n, r in runs.items()
                    },
                },
                indent=2,
            )
            + "\n"
        )
        print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
