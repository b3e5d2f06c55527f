"""Readers beside a running job: what an evaluation job costs the training run it reads, and
whether every step it takes can be read while retention keeps deleting.

    python benchmarks/readers_beside.py [--steps 40] [--rounds 3] [--mode async_with_pinned_mem]
                                        [--json benchmarks/results/readers_beside.json]

The reference trainer on 2 ranks saves every step with ``keep_latest_k 2``, three ways, the ways
interleaved round by round (same machine, same run of this script):
- ``alone``: no reader;
- ``holding``: a reader that holds the newest step, lets it go and takes the next one, without
  reading it (what holding costs the run, and nothing else);
- ``evaluating``: ``examples/evaluation_job.py --latest`` (verify with checksums, ``to-hf``,
  ``from_pretrained`` and 100 evaluation batches, at ``nice 10``), as a user would run it.
Per run: the median stall per save (the save's step and the next one, as the trainer's log
says: ``stall_s`` of each save event), the wall time, and the reader's reads (each held step
read, and whether it was read after two newer steps were published, which retention would have
deleted without the hold). Losses are compared with the ``alone`` run of the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "src" / "dcpkit" / "train" / "configs" / "llama3_debugmodel.toml"
WAYS = ["alone", "holding", "evaluating"]

HOLDING = """
import sys, time, dcpkit
from dcpkit.readers import run_state
from dcpkit.storage import open_store
folder, held = sys.argv[1], 0
while not open_store(folder).published_steps():
    time.sleep(0.2)
while True:
    running = run_state(open_store(folder))[0] == "running"
    with dcpkit.reading(folder, step="latest", purpose="holding reader"):
        time.sleep(1.0)
        held += 1
    if not running:
        break
print(held)
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL="ERROR")
    env.pop("DCPKIT_FAILPOINT", None)
    return env


def _nice() -> None:
    os.nice(10)


def one(way: str, dump: Path, opts: argparse.Namespace) -> dict:
    """One training run of ``opts.steps`` steps with the reader ``way``; what it measured."""
    from dcpkit.launch import torchrun_command

    folder = dump / "checkpoint"
    cmd = torchrun_command(2, [
        "--job.config_file", str(CONFIG), "--job.dump_folder", str(dump),
        "--training.steps", str(opts.steps), "--checkpoint.interval", "1",
        "--checkpoint.keep_latest_k", "2", "--checkpoint.async_mode", opts.mode,
        "--checkpoint.last_save_model_only", "false",
    ])  # fmt: skip
    reader = None
    if way == "holding":
        reader = [sys.executable, "-c", HOLDING, str(folder)]
    elif way == "evaluating":
        reader = [sys.executable, str(ROOT / "examples" / "evaluation_job.py"), str(folder),
                  str(dump / "exports"), "--latest", "--batches", "100"]  # fmt: skip
    start = time.perf_counter()
    train = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    side = None
    if reader is not None:
        side = subprocess.Popen(
            reader, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_nice,
        )  # fmt: skip
    log = train.communicate()[0].decode()
    took = time.perf_counter() - start
    if train.returncode != 0:
        raise SystemExit(f"training ({way}) failed:\n{log[-3000:]}")
    reads: list[dict] = []
    if side is not None:
        out, err = side.communicate(timeout=600)
        if side.returncode != 0:
            raise SystemExit(f"the {way} reader failed:\n{err[-3000:]}")
        reads = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
        if way == "holding":
            reads = [{"held": int(out.split()[-1])}]
    events = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    stalls = [e["stall_s"] for e in events if e.get("event") == "save"]
    losses = [e["loss"] for e in events if "loss" in e and "step" in e and "event" not in e]
    left = sorted(p.name for p in folder.iterdir() if p.name.startswith("step-"))
    return {
        "stall_s": statistics.median(stalls),
        "saves": len(stalls),
        "seconds": took,
        "losses": losses,
        "reads": reads,
        "left": left,
        "kept_for_readers": log.count("retention keeps step"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", default="async_with_pinned_mem")
    p.add_argument("--json", default="")
    opts = p.parse_args()
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="dcpkit-readers-") as tmp:
        for r in range(opts.rounds):
            for way in WAYS:
                run = one(way, Path(tmp) / f"{way}-{r}", opts)
                runs[way].append(run)
                print(f"round {r + 1} {way:<10} stall {run['stall_s']:.3f}s, "
                      f"{run['seconds']:.0f}s, reads {len(run['reads'])}", flush=True)  # fmt: skip
    base = statistics.median(r["stall_s"] for r in runs["alone"])
    results = {}
    for way, rs in runs.items():
        reads = [x for r in rs for x in r["reads"] if "step" in x]
        stall = statistics.median(r["stall_s"] for r in rs)
        results[way] = {
            "stall_s": stall,
            "vs_alone": stall / base,
            "seconds": statistics.median(r["seconds"] for r in rs),
            "losses_equal_alone": all(
                r["losses"] == a["losses"] for r, a in zip(rs, runs["alone"], strict=True)
            ),
            "reads": len(reads),
            "reads_verified": sum(bool(x["verified"]) for x in reads),
            "reads_outliving_retention": sum(x["newest_after"] >= x["step"] + 2 for x in reads),
            "holds": sum(x.get("held", 0) for r in rs for x in r["reads"]),
            "left": sorted({tuple(r["left"]) for r in rs}),
            "kept_for_readers": sum(r["kept_for_readers"] for r in rs),
            "stalls_by_round": [r["stall_s"] for r in rs],
        }
        print(f"{way:<10} stall {stall:.3f}s ({stall / base:.2f}x alone), {results[way]}")
    if opts.json:
        record = {
            "command": " ".join(["python", "benchmarks/readers_beside.py", *sys.argv[1:]]),
            "steps": opts.steps,
            "rounds": opts.rounds,
            "mode": opts.mode,
            "cpus": os.cpu_count(),
            "results": results,
        }
        Path(opts.json).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
