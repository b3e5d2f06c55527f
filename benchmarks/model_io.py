"""A real model's checkpoint through ``CheckpointManager``: load and save of Llama 3 8B shapes
(bfloat16, 15 GiB) at 1 and 2 ranks, each beside raw IO of the same bytes, with peak memory.

    python benchmarks/model_io.py [--flavor 8B] [--dtype bfloat16] [--nproc 1 2] [--json PATH]

The checkpoint is written once, tensor by tensor from random values (never the whole model in
memory), as the model-only DCP checkpoint a ``from-hf`` import gives. Then, for each world size,
one torchrun job (gloo, CPU) builds the model on the meta device, shards it with FSDP2 over the
ranks, materializes and touches its shards (the model's own memory, the baseline), and times,
slowest rank, all ranks starting together, medians of ``--reps`` runs whose order alternates:

- load: ``CheckpointManager.load_from(checkpoint, model_only=True)``, page cache dropped first,
  against a raw parallel read of the checkpoint's files (each rank its share, cut into as many
  contiguous byte ranges as the reader has threads, into a reused buffer), page cache dropped;
- save: ``CheckpointManager.save(step, force=True)`` (synchronous, durable, published), against
  a raw write + fsync of each rank's shard bytes into one file.

Peak memory is each rank's peak resident set during the operation (``VmHWM``, reset before it)
above the resident set of the materialized model: what the checkpoint costs beyond the model.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import report, run_ranks

DTYPES = ("bfloat16", "float32")


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the peak resident set (VmHWM)
        f.write("5")


def _raw_read(files: list[Path], threads: int, block: int = 64 << 20) -> int:
    """Read ``files`` as one stream cut into ``threads`` contiguous byte ranges (each thread
    reads its files front to back, as the checkpoint reader does), into one reused buffer per
    thread."""
    from io_speed import _contiguous_ranges

    def read(pieces: list[tuple[Path, int, int]]) -> int:
        buf = bytearray(block)
        view, total = memoryview(buf), 0
        for path, start, n in pieces:
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                done = 0
                while done < n:
                    got = f.readinto(view[: min(block, n - done)])
                    if not got:
                        break
                    done += got
            total += done
        return total

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(read, _contiguous_ranges(files, threads)))


def worker(src: Path, work: Path, flavor: str, dtype_name: str, reps: int) -> None:
    import torch
    import torch.distributed as td
    from io_speed import _raw_write
    from recovery import _evict, _local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dcpkit import CheckpointConfig, CheckpointManager
    from dcpkit.dist import io_threads
    from dcpkit.models import build_model

    td.init_process_group("gloo")
    rank, world = td.get_rank(), td.get_world_size()
    with torch.device("meta"):
        model = build_model("llama3", flavor, max_seq_len=256)
    model = model.to(getattr(torch, dtype_name))
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    tensors = [_local(p.detach()) for p in model.parameters()]
    for t in tensors:
        t.zero_()  # touched: the model's own memory is in the baseline
    rank_bytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, float] = {"rank_bytes": rank_bytes}

    runs: dict[str, list[float]] = {}

    def timed(key: str, fn) -> None:  # type: ignore[no-untyped-def]
        td.barrier()
        base = _rss("VmRSS")
        _reset_peak()
        t0 = time.perf_counter()
        fn()
        td.barrier()
        runs.setdefault(key, []).append(time.perf_counter() - t0)
        peak = key.replace("_s", "_peak_above_model")
        out[peak] = max(out.get(peak, 0), _rss("VmHWM") - base)

    files = sorted(p for p in src.iterdir() if p.is_file())
    mine = files[rank::world]
    threads = io_threads()
    cfg = CheckpointConfig(enable=True, folder=str(work / "out"), interval=1, keep_latest_k=0)
    mgr = CheckpointManager(cfg, work, model, save_rng=False)
    raw = work / f"raw-{rank}.bin"
    written: list[Path] = []  # the raw write's files

    def load() -> None:
        mgr.load_from(src, model_only=True)

    def save() -> None:
        mgr.save(len(runs.get("save_s", [])) + 1, force=True)

    def raw_write() -> None:
        written.extend(_raw_write(tensors, raw, threads))

    # Alternating which goes first, so that neither always meets the disk the other left.
    for rep in range(reps):
        for pair in (
            [("load_s", load), ("raw_read_s", lambda: _raw_read(mine, threads))],
            [("save_s", save), ("raw_write_fsync_s", raw_write)],
        ):
            for key, fn in pair if rep % 2 == 0 else pair[::-1]:
                if rank == 0:
                    _evict(src)
                timed(key, fn)
                td.barrier()
                if key == "save_s":
                    probe = next(iter(model.state_dict().values()))
                    out["loaded_nonzero"] = float(_local(probe.detach()).abs().sum() > 0)
                    saved = work / "out" / f"step-{len(runs['save_s'])}"
                    out["saved_bytes"] = sum(p.stat().st_size for p in saved.iterdir())
                    td.barrier()
                    if rank == 0:
                        shutil.rmtree(saved)  # room for what comes next
                elif key == "raw_write_fsync_s":
                    for path in written:
                        path.unlink()
                    written.clear()
                td.barrier()
    mgr.close()
    out.update({k: statistics.median(v) for k, v in runs.items()})
    out["threads"] = threads
    report(out)
    td.destroy_process_group()


ROWS = [
    ("load, page cache dropped", "load_s", "raw_read_s", "raw parallel read"),
    ("sync save (durable, published)", "save_s", "raw_write_fsync_s", "raw write + fsync"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="8B", help="Llama 3 flavor (default 8B)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=2, help="repetitions (medians reported)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder)")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts.worker[0], opts.worker[1], opts.flavor, opts.dtype, opts.reps)
        return 0
    import torch
    from convert import make_checkpoint

    from dcpkit.models.llama3 import LLAMA3_FLAVORS

    work = Path(tempfile.mkdtemp(prefix="dcpkit-model-io-", dir=opts.workdir))
    command = " ".join(["python", "benchmarks/model_io.py", *sys.argv[1:]])
    results: dict = {"command": command, "flavor": opts.flavor, "dtype": opts.dtype}
    results.update(reps=opts.reps, runs={})
    try:
        src = work / "checkpoint"
        t0 = time.perf_counter()
        args = LLAMA3_FLAVORS[opts.flavor]
        size = make_checkpoint(src, args, getattr(torch, opts.dtype))
        results["checkpoint_bytes"] = size
        print(
            f"Llama 3 {opts.flavor} ({opts.dtype}): checkpoint of {size / (1 << 30):.2f} GiB in "
            f"{len(list(src.iterdir()))} files, written in {time.perf_counter() - t0:.0f}s",
            flush=True,
        )
        for nproc in opts.nproc:
            scratch = work / f"job-{nproc}"
            scratch.mkdir()
            args = ["--flavor", opts.flavor, "--dtype", opts.dtype, "--reps", str(opts.reps)]
            job = run_ranks(__file__, nproc, [*args, "--worker", str(src), str(scratch)])
            shutil.rmtree(scratch, ignore_errors=True)
            if job.ranks is None:
                print(job.tail, file=sys.stderr)
                return 1
            if job.returncode != 0:  # every rank had finished and reported: said, not hidden
                print(f"note: the {nproc}-rank job exited with {job.returncode} after its results")
                results.setdefault("exit_codes", {})[nproc] = job.returncode
            ranks = job.ranks
            if not all(r["loaded_nonzero"] for r in ranks):
                print("the load left the model's first tensor zero", file=sys.stderr)
                return 1
            slowest = {k: max(r[k] for r in ranks) for k in ranks[0]}
            results["runs"][nproc] = {"slowest": slowest, "ranks": ranks}
            gib = size / (1 << 30)
            print(f"\n{nproc} rank(s), {ranks[0]['threads']} read threads per rank")
            print("| operation | seconds | GiB/s | baseline | seconds | x baseline speed |")
            print("|---|---|---|---|---|---|")
            for name, key, base, base_name in ROWS:
                s, b = slowest[key], slowest[base]
                print(f"| {name} | {s:.2f} | {gib / s:.2f} | {base_name} | {b:.2f} | {b / s:.2f} |")
            for key in ("load_peak_above_model", "save_peak_above_model"):
                print(
                    f"{key.replace('_', ' ')}: {slowest[key] / (1 << 20):.0f} MiB (max over ranks)"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if opts.json:
        opts.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
