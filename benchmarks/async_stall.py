"""Checkpoint stall benchmark: how long training is blocked per save, by async mode.

    python benchmarks/async_stall.py [--gb 1.5] [--saves 6] [--device cpu|cuda] [--json PATH]

One run measures, for a Llama-shaped model + AdamW state of about ``--gb`` GiB:
- blocked time per save (``save()`` + ``maybe_wait_for_staging()``), median from the third save,
  for dcpkit's ``disabled``, ``async`` and ``async_with_pinned_mem`` and for PyTorch's
  ``dcp.async_save`` with its default stager;
- the floor: a plain ``copy_`` of the same state into preallocated buffers (on CUDA: into pinned
  host buffers, non-blocking, then synchronized);
- total time to durable completion, peak RSS and RSS after every save;
- synchronous save and load throughput against a raw write+fsync and read of the same bytes,
  and the share of the save spent on checksums;
- backpressure: saves requested faster than the disk writes them (a fixed amount of real compute
  between saves, half a synchronous save's time unless ``--pressure-compute`` says otherwise):
  blocked time per save for every asynchronous mode beside what the disk forces (the durable
  time of one save minus the compute since the last one).

Each mode runs in its own process so that its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _launch import read_result  # this script's folder is on sys.path

MODES = ["disabled", "async", "async_with_pinned_mem", "torch_async_save"]
ASYNC_MODES = MODES[1:]


def _rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def build_state(gib: float, device: str, shard=None, dim: int = 1024):  # type: ignore[no-untyped-def]
    """A Llama 3 shaped model of width ``dim`` and an AdamW with its state materialized (12
    bytes a parameter), as many layers as make about ``gib`` GiB; ``shard(model)``, if given,
    parallelizes the model while it is still on the meta device."""
    from dcpkit.models import build_model
    from dcpkit.models.llama3 import Llama3Args

    params_wanted = gib * (1 << 30) / 12
    vocab = 32000
    hidden = Llama3Args(dim=dim, multiple_of=256).ffn_hidden_dim
    per_layer = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    layers = max(1, round((params_wanted - 2 * vocab * dim) / per_layer))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(
            "llama3",
            "debugmodel",
            dim=dim,
            n_layers=layers,
            n_heads=dim // 64,
            vocab_size=vocab,
            multiple_of=256,
            max_seq_len=64,
        )
    if shard is not None:
        shard(model)
    model.to_empty(device=device)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _tensors(model, opt) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def worker(mode: str, gib: float, saves: int, device: str, work: Path) -> dict:
    import torch.distributed as td

    from dcpkit import CheckpointConfig, CheckpointManager

    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    model, opt = build_state(gib, device)
    tensors = _tensors(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    blocked, total, rss, extra = [], [], [], {}
    folder = work / mode
    if mode == "torch_async_save":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        pending = None
        for i in range(1, saves + 1):
            msd, osd = get_state_dict(model, opt)
            t0 = time.perf_counter()
            pending = dcp.async_save(
                {"model": msd, "optim": osd}, checkpoint_id=str(folder / f"step-{i}")
            )
            blocked.append(time.perf_counter() - t0)
            pending.result()
            total.append(time.perf_counter() - t0)
            rss.append(_rss())
            shutil.rmtree(folder / f"step-{i - 1}", ignore_errors=True)
    else:
        cfg = CheckpointConfig(
            enable=True, interval=1, keep_latest_k=2, async_mode=mode, verify_on_load=False
        )
        mgr = CheckpointManager(cfg, folder, model, optimizer=opt)
        checksum_share = []
        for i in range(1, saves + 1):
            _sync(device)
            t0 = time.perf_counter()
            mgr.save(i)
            mgr.maybe_wait_for_staging()
            blocked.append(time.perf_counter() - t0)
            mgr.wait()  # durable, and old steps deleted
            total.append(time.perf_counter() - t0)
            rss.append(_rss())
            if mode == "disabled":
                checksum_share.append(mgr.last_checksum_s / total[-1])
        if mode == "disabled":
            extra["checksum_share_of_save"] = statistics.median(checksum_share)
            ckpt = folder / "checkpoint" / f"step-{saves}"
            ckpt_bytes = sum(p.stat().st_size for p in ckpt.iterdir())
            t0 = time.perf_counter()
            mgr.load_from(ckpt)
            _sync(device)
            extra["load_s"] = time.perf_counter() - t0
            extra["checkpoint_bytes"] = ckpt_bytes
            extra.update(_raw_io(tensors, work / "raw.bin"))
        mgr.close()
    # The floor: a copy of the same tensors into preallocated host buffers.
    pin = device == "cuda"
    buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in tensors]
    copies = []
    for _ in range(max(3, saves)):
        _sync(device)
        t0 = time.perf_counter()
        for b, t in zip(buffers, tensors):
            b.copy_(t, non_blocking=pin)
        _sync(device)
        copies.append(time.perf_counter() - t0)
    td.destroy_process_group()
    return {
        "mode": mode,
        "state_bytes": state_bytes,
        "blocked_s": blocked,
        "total_s": total,
        "rss_after_save": rss,
        "peak_rss": _rss("VmHWM"),
        "copy_floor_s": statistics.median(copies[1:]),
        **extra,
    }


def _compute_kernel() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(384, 384), torch.randn(384, 384)


def _compute(iters: int, ab: tuple[torch.Tensor, torch.Tensor]) -> None:
    """A training step's stand-in: real CPU work (matmuls), not a sleep."""
    a, b = ab
    for _ in range(iters):
        a = torch.tanh(a @ b)


def pressure_worker(mode: str, gib: float, saves: int, compute_s: float, work: Path) -> dict:
    """Saves spaced ``compute_s`` of compute apart (measured without saves, same process)."""
    import torch.distributed as td

    from dcpkit import CheckpointConfig, CheckpointManager

    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    model, opt = build_state(gib, "cpu")
    ab = _compute_kernel()
    _compute(20, ab)
    t0 = time.perf_counter()
    _compute(200, ab)
    iters = max(1, round(compute_s * 200 / (time.perf_counter() - t0)))
    t0 = time.perf_counter()
    _compute(iters, ab)
    alone_s = time.perf_counter() - t0
    folder = work / f"pressure-{mode}"
    blocked, computed = [], []
    start = time.perf_counter()
    if mode == "torch_async_save":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        pending, purges = None, []
        for i in range(1, saves + 1):
            t0 = time.perf_counter()
            _compute(iters, ab)
            computed.append(time.perf_counter() - t0)
            msd, osd = get_state_dict(model, opt)
            t0 = time.perf_counter()
            if pending is not None:
                pending.result()  # one save in flight at a time, as TorchTitan does
            pending = dcp.async_save(
                {"model": msd, "optim": osd}, checkpoint_id=str(folder / f"step-{i}")
            )
            blocked.append(time.perf_counter() - t0)
            # Old steps are deleted off the training thread, as TorchTitan's purge thread does.
            old = folder / f"step-{i - 2}"
            purges.append(threading.Thread(target=shutil.rmtree, args=(old, True)))
            purges[-1].start()
        pending.result()
        for t in purges:
            t.join()
    else:
        cfg = CheckpointConfig(
            enable=True, interval=1, keep_latest_k=2, async_mode=mode, verify_on_load=False
        )
        mgr = CheckpointManager(cfg, folder, model, optimizer=opt)
        for i in range(1, saves + 1):
            t0 = time.perf_counter()
            _compute(iters, ab)
            computed.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mgr.save(i)
            mgr.maybe_wait_for_staging()
            blocked.append(time.perf_counter() - t0)
        mgr.wait()
        mgr.close()
    total = time.perf_counter() - start
    td.destroy_process_group()
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "mode": mode,
        "compute_alone_s": alone_s,
        "compute_s": computed,
        "blocked_s": blocked,
        "total_s": total,
    }


def _raw_io(tensors: list[torch.Tensor], path: Path) -> dict:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            f.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    read_s = time.perf_counter() - t0
    size = path.stat().st_size
    path.unlink()
    return {"raw_write_fsync_s": write_s, "raw_read_s": read_s, "raw_bytes": size}


def _spawn(worker: str, opts: argparse.Namespace, work: Path, extra: list[str] = ()) -> dict:
    """One measurement in a process of its own (its peak RSS is its own)."""
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--_worker",
            worker,
            "--gb",
            str(opts.gb),
            "--saves",
            str(opts.saves),
            "--device",
            opts.device,
            "--workdir",
            str(work),
            *extra,
        ],
        capture_output=True,
        text=True,
    )
    result = read_result(proc.stdout)
    if proc.returncode != 0 or result is None:
        print(f"{worker}: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
        return {"mode": worker, "error": proc.stderr[-3000:]}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.5, help="state size in GiB (default 1.5)")
    parser.add_argument("--saves", type=int, default=6, help="saves per mode (>= 3)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder)")
    parser.add_argument(
        "--pressure-compute",
        type=float,
        help="seconds of compute between saves in the backpressure scenario (default: half the "
        "durable time of a synchronous save measured in this run; 0 skips the scenario)",
    )
    parser.add_argument("--_worker", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.saves < 3:
        parser.error("--saves must be >= 3 (medians are taken from the third save on)")
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if opts._worker and opts._worker.startswith("pressure:"):
        mode = opts._worker.split(":", 1)[1]
        res = pressure_worker(mode, opts.gb, opts.saves, opts.pressure_compute, opts.workdir)
        print("RESULT " + json.dumps(res))
        return 0
    if opts._worker:
        res = worker(opts._worker, opts.gb, opts.saves, opts.device, opts.workdir)
        print("RESULT " + json.dumps(res))
        return 0
    work = Path(tempfile.mkdtemp(prefix="dcpkit-stall-", dir=opts.workdir))
    results: dict[str, dict] = {}
    pressure: dict[str, dict] = {}

    def dump(partial: bool, **extra: float) -> None:
        if opts.json:  # what is measured so far survives a run cut short
            command = " ".join(["python", "benchmarks/async_stall.py", *sys.argv[1:]])
            out = {"command": command, "device": opts.device, "saves": opts.saves}
            out.update(partial=partial, cpus=os.cpu_count(), **extra)
            out.update(results=results, pressure=pressure)
            opts.json.write_text(json.dumps(out, indent=2) + "\n")

    try:
        for mode in MODES:
            results[mode] = r = _spawn(mode, opts, work)
            if "error" not in r:
                print(
                    f"  measured {mode}: blocked {statistics.median(r['blocked_s'][2:]):.3f}s, "
                    f"copy floor {r['copy_floor_s']:.3f}s",
                    flush=True,
                )
            dump(True)
        sync = results.get("disabled", {})
        compute = opts.pressure_compute
        if compute is None and "total_s" in sync and opts.device == "cpu":
            compute = 0.5 * statistics.median(sync["total_s"][2:])
        if compute:
            for mode in ASYNC_MODES:
                pressure[mode] = r = _spawn(
                    f"pressure:{mode}", opts, work, ["--pressure-compute", f"{compute:.3f}"]
                )
                if "error" not in r:
                    print(
                        f"  measured {mode} under backpressure: blocked "
                        f"{statistics.median(r['blocked_s'][2:]):.3f}s",
                        flush=True,
                    )
                dump(True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = {m: r for m, r in results.items() if "error" not in r}
    if not ok:
        print("every mode failed; nothing to report", file=sys.stderr)
        return 1
    floor = statistics.median(r["copy_floor_s"] for r in ok.values())
    sync = statistics.median(ok["disabled"]["blocked_s"][2:]) if "disabled" in ok else None
    gib = next(iter(ok.values()))["state_bytes"] / (1 << 30)
    print(
        f"\nstate: {gib:.2f} GiB (model + AdamW) on {opts.device}; medians from save 3 of "
        f"{opts.saves}"
    )
    floor_name = "pinned D2H copy" if opts.device == "cuda" else "copy_ into buffers"
    print(f"floor ({floor_name}): {floor:.3f}s")
    print(
        f"\n{'mode':<24} {'blocked s':>10} {'x floor':>8} {'x sync':>7} {'durable s':>10} "
        f"{'peak RSS':>10} {'RSS growth 2->N':>16}"
    )
    for mode, r in results.items():
        if "error" in r:
            print(f"{mode:<24} failed")
            continue
        b = statistics.median(r["blocked_s"][2:])
        d = statistics.median(r["total_s"][2:])
        growth = r["rss_after_save"][-1] - r["rss_after_save"][1]
        r.update(
            blocked_median_s=b,
            durable_median_s=d,
            x_floor=b / floor,
            x_sync=(b / sync) if sync else None,
            rss_growth_after_second_save=growth,
        )
        xs = f"{b / sync:7.3f}" if sync else "      -"
        print(
            f"{mode:<24} {b:>10.3f} {b / floor:>8.2f} {xs} {d:>10.3f} "
            f"{r['peak_rss'] / (1 << 30):>8.2f} G {growth / (1 << 20):>12.1f} MiB"
        )
    if "disabled" in ok:
        r = ok["disabled"]
        save_s = statistics.median(r["total_s"][2:])
        gbps = r["checkpoint_bytes"] / (1 << 30)
        print(
            f"\nsync save: {gbps / save_s:.2f} GiB/s vs raw write+fsync "
            f"{r['raw_bytes'] / (1 << 30) / r['raw_write_fsync_s']:.2f} GiB/s; load: "
            f"{gbps / r['load_s']:.2f} GiB/s vs raw read "
            f"{r['raw_bytes'] / (1 << 30) / r['raw_read_s']:.2f} GiB/s"
        )
        print(f"checksums: {100 * r['checksum_share_of_save']:.1f}% of the sync save time")
    _report_pressure(pressure, ok)
    dump(False, floor_s=floor)
    if opts.json:
        print(f"\nwrote {opts.json}")
    return 0


def _report_pressure(pressure: dict[str, dict], idle: dict[str, dict]) -> None:
    """Blocked time per save when saves come faster than the disk writes them, beside what the
    disk forces: the mode's own durable time of an idle save minus the compute between saves."""
    if not pressure:
        return
    print("\nbackpressure: saves spaced by less compute than a write takes (medians from save 3)")
    print(
        f"{'mode':<24} {'compute s':>10} {'alone s':>8} {'blocked s':>10} {'forced s':>9} "
        f"{'x torch':>8}"
    )
    torch_b = None
    if "blocked_s" in pressure.get("torch_async_save", {}):
        torch_b = statistics.median(pressure["torch_async_save"]["blocked_s"][2:])
    for mode, r in pressure.items():
        if "error" in r:
            print(f"{mode:<24} failed")
            continue
        b = statistics.median(r["blocked_s"][2:])
        c = statistics.median(r["compute_s"][2:])
        durable = idle.get(mode, {}).get("total_s")
        forced = max(0.0, statistics.median(durable[2:]) - c) if durable else None
        r.update(
            blocked_median_s=b,
            compute_median_s=c,
            forced_s=forced,
            x_torch=(b / torch_b) if torch_b else None,
        )
        fs = f"{forced:>9.3f}" if forced is not None else "        -"
        xt = f"{b / torch_b:>8.2f}" if torch_b else "       -"
        print(f"{mode:<24} {c:>10.3f} {r['compute_alone_s']:>8.3f} {b:>10.3f} {fs} {xt}")


if __name__ == "__main__":
    sys.exit(main())
