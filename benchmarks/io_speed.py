"""IO at the limit: checkpoint save and load against raw IO of the same bytes, in one run.

    python benchmarks/io_speed.py [--gb 4 [2 ...]] [--dim 1024] [--nproc 1 2] [--reps 5]
        [--json PATH] [--png PATH]

For each state size and world size, a Llama-shaped model + AdamW state of about ``--gb`` GiB
(width ``--dim``, as many layers as that takes) is FSDP-sharded over the ranks (torchrun, gloo).
Everything timed goes through ``CheckpointManager``'s public API, slowest rank, all ranks
starting together:
- sync save (``save()`` of a full checkpoint, durable and published, by a manager that has
  saved before, as every save of a run but its first) against a raw write of each rank's state
  bytes with as many threads as the checkpoint writer has, a file each, each fsynced, each
  write right after the previous one of its kind was deleted; and, once, a run's first save
  (which also takes the folder's lease and plans);
- load (``load()`` of a manager, as at a resume) with ``verify_on_load`` off and on, against a raw
  parallel read of the checkpoint's files into memory (the same bytes, the same threads per
  rank, each a contiguous byte range of the rank's files) - with the page cache warm, and
  dropped (every file evicted with ``posix_fadvise``) before each cold read; and, beside it,
  what a loop without dcpkit does: PyTorch's ``dcp.load`` (its ``FileSystemReader``) +
  ``set_state_dict`` of the same state, saved by ``dcp.save``;
- two floors, warm: DCP's own steps of a load with a reader that reads no bytes (the state
  dicts, ``.metadata``, planning, ``set_state_dict``: what any DCP ``StorageReader`` adds to its
  reads), and the raw parallel read hashing every byte as it lands (what any verification adds);
  beside them the CPU time (every thread's, all ranks) of the warm loads, and of xxh3-64 alone
  over as many bytes (the CPU any verification of them takes, whatever reads them).
Medians over ``--reps`` runs, each running the loads in a rotated order. With ``--json``, the
throughput plot (GiB/s of save, warm load and cold load against the checkpoint's size, beside
the raw IO, a panel per world size) is written next to it as PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _launch import report, run_ranks

from dcpkit.formats.torchfile import HASH_BLOCK


def _raw_write(tensors: list[torch.Tensor], path: Path, threads: int = 1) -> list[Path]:
    """Write the bytes of ``tensors`` as ``threads`` files written in parallel (``path``.0, ...;
    the tensor list cut into byte-balanced runs, as the checkpoint writer cuts a large share),
    each fsynced. Returns the files."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    runs: list[list[torch.Tensor]] = [[]]
    acc = 0
    for t in tensors:
        if runs[-1] and acc >= total / threads * len(runs) and len(runs) < threads:
            runs.append([])
        runs[-1].append(t)
        acc += t.numel() * t.element_size()
    files = [path.with_name(f"{path.name}.{i}") for i in range(len(runs))]

    def write(i: int) -> None:
        with open(files[i], "wb") as f:
            for t in runs[i]:
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())

    with ThreadPoolExecutor(len(runs)) as pool:
        list(pool.map(write, range(len(runs))))
    return files


def _contiguous_ranges(files: list[Path], threads: int) -> list[list[tuple[Path, int, int]]]:
    """``files`` as one stream cut into ``threads`` contiguous byte ranges ``(file, start,
    bytes)``: each thread reads its files front to back, as the checkpoint reader does."""
    sizes = [p.stat().st_size for p in files]
    share = max(1, -(-sum(sizes) // threads))
    ranges: list[list[tuple[Path, int, int]]] = [[]]
    left = share
    for path, size in zip(files, sizes):
        at = 0
        while at < size:
            n = min(size - at, left)
            ranges[-1].append((path, at, n))
            at, left = at + n, left - n
            if left == 0:
                ranges.append([])
                left = share
    return [r for r in ranges if r]


def _raw_read(files: list[Path], threads: int, into: torch.Tensor, hashed: bool = False) -> None:
    """Read ``files`` into ``into`` (preallocated, as large as they are) with ``threads``
    threads, each a contiguous byte range; ``hashed``: each thread reads blocks of the size
    verify-on-load hashes and feeds each to an xxh3-64 as it lands (the least any
    verification costs)."""
    view = into.numpy()
    ranges: list[list[tuple[Path, int, int, int]]] = []
    at = 0
    for pieces in _contiguous_ranges(files, threads):
        ranges.append([])
        for path, start, n in pieces:
            ranges[-1].append((path, start, n, at))
            at += n

    def read(pieces: list[tuple[Path, int, int, int]]) -> None:
        h = xxhash.xxh3_64() if hashed else None
        step = HASH_BLOCK if hashed else 16 << 20
        for path, start, n, dest in pieces:
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                mv, got = memoryview(view[dest : dest + n]), 0
                while got < n:
                    block = f.readinto(mv[got : got + step])
                    if h is not None:
                        h.update(mv[got : got + block])
                    got += block

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, ranges))


def _hash_only(nbytes: int) -> None:
    """xxh3-64 of ``nbytes`` bytes, one ``HASH_BLOCK`` from a core's cache at a time: the CPU
    any verification of that many bytes takes, with no read around it."""
    block = memoryview(os.urandom(HASH_BLOCK))
    h = xxhash.xxh3_64()
    for _ in range(nbytes // HASH_BLOCK):
        h.update(block)


def _no_bytes_reader() -> type:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.futures import Future

    class NoBytesReader(FileSystemReader):
        """DCP's file system reader, reading ``.metadata`` and no data."""

        def read_data(self, plan, planner):  # type: ignore[no-untyped-def]
            done: Future[None] = Future()
            done.set_result(None)
            return done

    return NoBytesReader


def worker(gib: float, work: Path, reps: int, dim: int) -> None:
    import torch.distributed as td
    from recovery import _evict, _local, build

    from dcpkit import CheckpointConfig, CheckpointManager
    from dcpkit.dist import io_threads
    from dcpkit.layout import rank_file_prefix

    no_bytes_reader = _no_bytes_reader()
    td.init_process_group("gloo")
    rank, world = td.get_rank(), td.get_world_size()
    model, opt = build(gib, dim)
    tensors = [_local(p.detach()) for p in model.parameters()]
    for st in opt.state.values():
        tensors += [_local(v) for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    rank_bytes = sum(t.numel() * t.element_size() for t in tensors)
    out: dict[str, list[float]] = {}

    def timed(key: str, fn):  # type: ignore[no-untyped-def]
        """Wall time of ``fn`` (all ranks starting together, to the last one's end) in
        ``key``, and this process's CPU time (every thread's) in ``key`` with ``_cpu``."""
        td.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        c1 = time.process_time()
        td.barrier()
        out.setdefault(key, []).append(time.perf_counter() - t0)
        out.setdefault(key[:-2] + "_cpu", []).append(c1 - c0)
        return result

    folder = work / "run"
    threads = io_threads()
    # One manager saves every step, as in a run: its first save also takes the folder's lease
    # and plans; the later ones (the "sync save" row) reuse the plan.
    cfg = CheckpointConfig(enable=True, interval=1, keep_latest_k=0)
    mgr = CheckpointManager(cfg, folder, model, optimizer=opt)
    # Each timed write follows the deletion of as many bytes of its own kind (the previous
    # step; the previous raw files): on this project's machine, page-cache pages a deleted file
    # just freed are written several times faster than pages from the free pool.
    raw = work / f"raw-{rank}.bin"
    written = _raw_write(tensors, raw, threads)  # untimed: the raw writes' first pages
    timed("first_save_s", lambda: mgr.save(1, force=True))
    last = reps + 1
    for step in range(2, last + 1):
        if rank == 0:  # only the last step stays on disk
            shutil.rmtree(folder / "checkpoint" / f"step-{step - 1}")
        td.barrier()
        timed("save_s", lambda: mgr.save(step, force=True))  # noqa: B023
        for path in written:
            path.unlink()
        written = timed("raw_write_fsync_s", lambda: _raw_write(tensors, raw, threads))
    for path in written:
        path.unlink()
    mgr.close()
    ckpt = folder / "checkpoint" / f"step-{last}"
    files = sorted(p for p in ckpt.iterdir() if p.is_file())
    own = [p for p in files if p.name.startswith(rank_file_prefix(rank))]  # this rank wrote
    mine = own if world > 1 and own else files[rank::world]
    into = torch.empty(sum(p.stat().st_size for p in mine), dtype=torch.uint8)
    into.fill_(0)

    managers = {
        verify: CheckpointManager(
            CheckpointConfig(enable=True, interval=1, verify_on_load=verify),
            folder,
            model,
            optimizer=opt,
        )
        for verify in (False, True)
    }

    def load(verify: bool) -> None:
        assert managers[verify].load() == last

    def torch_load(reader=None) -> None:  # type: ignore[no-untyped-def]
        """What a loop without dcpkit does: DCP's own reader, then set_state_dict. With a
        ``reader`` that reads no bytes: what any DCP ``StorageReader`` pays before and after
        its bytes (the state dicts, ``.metadata``, DCP's planning and ``set_state_dict``)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(work / "torch"), storage_reader=reader)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(work / "torch"))
    del msd, osd

    warm = [
        ("raw_read_warm_s", lambda: _raw_read(mine, threads, into)),
        ("load_warm_s", lambda: load(False)),
        ("load_verify_warm_s", lambda: load(True)),
        ("torch_load_warm_s", torch_load),
        ("raw_read_hashed_warm_s", lambda: _raw_read(mine, threads, into, hashed=True)),
        ("dcp_floor_warm_s", lambda: torch_load(no_bytes_reader(str(work / "torch")))),
        ("xxh3_only_s", lambda: _hash_only(into.numel())),
    ]
    cold = [
        ("raw_read_cold_s", lambda: _raw_read(mine, threads, into)),
        ("load_cold_s", lambda: load(False)),
        ("load_verify_cold_s", lambda: load(True)),
        ("torch_load_cold_s", torch_load),
    ]
    # Each repetition starts one operation further along: none is always first or always
    # right after another.
    for rep in range(reps):
        for key, fn in warm[rep % len(warm) :] + warm[: rep % len(warm)]:
            timed(key, fn)
    for rep in range(reps):
        for key, fn in cold[rep % len(cold) :] + cold[: rep % len(cold)]:
            if rank == 0:
                _evict(ckpt)
                _evict(work / "torch")
            timed(key, fn)
    for mgr in managers.values():
        mgr.close()
    ckpt_bytes = sum(p.stat().st_size for p in files)
    result = {k: statistics.median(v) for k, v in out.items()}
    result.update(rank_bytes=rank_bytes, checkpoint_bytes=ckpt_bytes, threads=threads)
    result.update(tensors=len(tensors), layers=len(model.layers))
    report(result)
    td.destroy_process_group()


ROWS = [
    ("sync save", "save_s", "raw_write_fsync_s", "raw write + fsync"),
    ("sync save, a run's first", "first_save_s", "raw_write_fsync_s", "raw write + fsync"),
    ("load, page cache warm", "load_warm_s", "raw_read_warm_s", "raw parallel read"),
    ("load + verify, warm", "load_verify_warm_s", "raw_read_warm_s", "raw parallel read"),
    ("load, page cache dropped", "load_cold_s", "raw_read_cold_s", "raw parallel read"),
    ("load + verify, dropped", "load_verify_cold_s", "raw_read_cold_s", "raw parallel read"),
    (
        "PyTorch dcp.load + set_state_dict, warm",
        "torch_load_warm_s",
        "raw_read_warm_s",
        "raw parallel read",
    ),
    (
        "PyTorch dcp.load + set_state_dict, dropped",
        "torch_load_cold_s",
        "raw_read_cold_s",
        "raw parallel read",
    ),
]


def _run(gb: float, nproc: int, opts: argparse.Namespace) -> dict | None:
    """One torchrun job at ``gb`` GiB on ``nproc`` ranks; prints its table; None on failure."""
    work = Path(tempfile.mkdtemp(prefix="dcpkit-io-", dir=opts.workdir))
    try:
        args = ["--gb", str(gb), "--reps", str(opts.reps), "--dim", str(opts.dim)]
        args += ["--worker", str(work)]
        job = run_ranks(__file__, nproc, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if job.returncode != 0 or job.ranks is None:
        print(job.tail, file=sys.stderr)
        return None
    ranks = job.ranks
    slowest = {k: max(r[k] for r in ranks) for k in ranks[0] if k.endswith("_s")}
    size = ranks[0]["checkpoint_bytes"]
    state = sum(r["rank_bytes"] for r in ranks)
    result = {"gb": gb, "nproc": nproc, "slowest": slowest, "ranks": ranks}
    result["checkpoint_bytes"] = size
    count = ranks[0]["tensors"]
    print(
        f"\n{nproc} rank(s): {state / (1 << 30):.2f} GiB of model + AdamW state (width "
        f"{opts.dim}, {ranks[0]['layers']} layers: {count} tensors of "
        f"{state / count / (1 << 20):.1f} MiB on average), checkpoint "
        f"{size / (1 << 30):.2f} GiB, {ranks[0]['threads']} read threads per rank"
    )
    print("| operation | seconds | GiB/s | baseline | baseline GiB/s | x baseline |")
    print("|---|---|---|---|---|---|")
    for name, key, base, base_name in ROWS:
        s, b = slowest[key], slowest[base]
        gbps = size / (1 << 30) / s
        print(
            f"| {name} | {s:.3f} | {gbps:.2f} | {base_name} | "
            f"{size / (1 << 30) / b:.2f} | {b / s:.2f} |"
        )
    verify_cost = slowest["load_verify_warm_s"] / slowest["load_warm_s"] - 1
    print(f"verify-on-load costs {100 * verify_cost:+.1f}% (warm)")
    raw, floor = slowest["raw_read_warm_s"], slowest["dcp_floor_warm_s"]
    ours = raw / slowest["load_warm_s"]
    print(
        f"DCP's own steps of a load, no bytes read (its FileSystemReader reading none: state "
        f"dicts, .metadata, planning, set_state_dict): {floor:.3f} s; raw + that: "
        f"{raw / (raw + floor):.2f} x raw; dcpkit's warm load: {ours:.2f} x raw"
    )
    hashed = slowest["raw_read_hashed_warm_s"]
    print(
        f"the raw read hashing every byte as it lands (xxh3-64): {hashed:.3f} s, "
        f"{100 * (hashed / raw - 1):+.1f}% over the raw read, "
        f"{100 * (hashed - raw) / slowest['load_warm_s']:+.1f}% of dcpkit's warm load"
    )
    cpu = {k: sum(r[k] for r in ranks) for k in ranks[0] if k.endswith("_cpu")}
    result["cpu"] = cpu
    load, verify, hash_cpu = cpu["load_warm_cpu"], cpu["load_verify_warm_cpu"], cpu["xxh3_only_cpu"]
    print(
        f"CPU time, every thread of all ranks, warm: load {load:.3f} s, load + verify "
        f"{verify:.3f} s ({verify - load:+.3f} s); xxh3-64 alone of as many bytes, from a "
        f"core's cache: {hash_cpu:.3f} s ({100 * hash_cpu / load:.1f}% of the load's CPU)"
    )
    # The hash's CPU comes on top of the load's wall time but for what the cores' idle time
    # during the load could absorb: the least verify-on-load can cost, whatever its reader.
    cores = os.cpu_count() or 1
    capacity = cores * slowest["load_warm_s"]
    idle = max(0.0, capacity - load)
    result["verify_floor"] = max(0.0, hash_cpu - idle) / capacity
    print(
        f"the cores were {100 * load / capacity:.0f}% busy during a warm load ({cores} cores): "
        f"the hash alone costs it at least {100 * result['verify_floor']:+.1f}% even with every "
        "idle cycle hashing"
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gb", type=float, nargs="+", default=[4.0], help="state sizes, GiB (a run each)"
    )
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--dim", type=int, default=1024, help="model width (layers are added to reach --gb)"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png", type=Path, help="throughput plot (default: next to --json)")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder)")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts.gb[0], opts.worker, opts.reps, opts.dim)
        return 0
    runs = []
    for gb in opts.gb:
        for nproc in opts.nproc:
            run = _run(gb, nproc, opts)
            if run is None:
                return 1
            runs.append(run)
    if opts.json:
        command = " ".join(["python", "benchmarks/io_speed.py", *sys.argv[1:]])
        out = {"command": command, "dim": opts.dim, "reps": opts.reps, "runs": runs}
        opts.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {opts.json}")
    png = opts.png or (opts.json.with_suffix(".png") if opts.json else None)
    if png:
        _plot(runs, opts.dim, png)
        print(f"wrote {png}")
    return 0


PLOTTED = [  # (operation of ROWS, the label of its baseline in the plot)
    ("sync save", "raw write + fsync"),
    ("load, page cache warm", "raw parallel read, page cache warm"),
    ("load, page cache dropped", "raw parallel read, page cache dropped"),
]


def _plot(runs: list[dict], dim: int, png: Path) -> None:
    """GiB/s of each operation of ``PLOTTED`` against the checkpoint's size, a panel per world
    size, beside its raw baseline of the same run."""
    from _plot import throughput_png

    keys = {name: (key, base) for name, key, base, _ in ROWS}
    panels: dict[str, list] = {}
    for nproc in sorted({r["nproc"] for r in runs}):
        mine = [r for r in runs if r["nproc"] == nproc]
        pairs = []
        gib = [r["checkpoint_bytes"] / (1 << 30) for r in mine]
        for name, raw_name in PLOTTED:
            key, base = keys[name]
            ours = [(g, g / r["slowest"][key]) for g, r in zip(gib, mine)]
            raw = [(g, g / r["slowest"][base]) for g, r in zip(gib, mine)]
            pairs.append(((name, ours), (raw_name, raw)))
        panels[f"{nproc} rank{'s' if nproc > 1 else ''}"] = pairs
    throughput_png(png, f"CheckpointManager vs raw IO: model + AdamW, width {dim}", panels)


if __name__ == "__main__":
    sys.exit(main())
