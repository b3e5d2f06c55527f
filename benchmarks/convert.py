"""Conversion benchmark: wall time and peak RSS of dcpkit's streaming conversions against
PyTorch's ``dcp_to_torch_save`` and a raw read+write of the same bytes, measured in one run.

    python benchmarks/convert.py [--gb 2 [4 ...]] [--json results.json] [--workdir DIR]
    python benchmarks/convert.py --flavor 8B [--dtype bfloat16] ...   # a real model's shapes

``--flavor`` writes a Llama 3 flavor's exact shapes (8B: 16 GB in bfloat16), tensor by tensor
from random values, never the whole model in memory. PyTorch's ``dcp_to_torch_save`` holds the
whole checkpoint in memory: it is skipped, and said so, when the checkpoint exceeds 40% of the
machine's memory.

Each operation runs in its own process; its peak RSS (``ru_maxrss``) is reported above the
baseline of a process that imports the same modules and converts nothing. Every operation starts
with the page cache of the checkpoint dropped (what a job that converts a checkpoint it did not
just write sees), the raw read+write included, so that none reads what another left cached;
and, on a virtual machine that reports free pages to its host, after waiting (``--settle``
seconds at most) for the host to take back the memory freed before it (``host_memory.settle``):
otherwise an operation's writes run at one of two speeds, several times apart, depending on
what ran just before it.
With ``--json``, the throughput plot (each conversion's GiB/s against the checkpoint's size,
beside the raw read+write) is written next to it as PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dcpkit.convert.adapters import get_adapter
from dcpkit.formats.dcp import meta_tensor, write_dcp
from dcpkit.models.llama3 import LLAMA3_FLAVORS, Llama3Args

IMPORTS = (
    "import torch, dcpkit.convert.hf, dcpkit.convert.torch_save, "
    "torch.distributed.checkpoint.format_utils"
)
OPS = {
    "baseline (imports only)": "pass",
    "raw read+write": (  # into one reused buffer: no allocation per block
        "import os, pathlib\n"
        "out = open(OUT + '/raw.bin', 'wb')\n"
        "buf = memoryview(bytearray(16 << 20))\n"
        "for p in sorted(pathlib.Path(CKPT).iterdir()):\n"
        "    with open(p, 'rb', buffering=0) as f:\n"
        "        while n := f.readinto(buf): out.write(buf[:n])\n"
        "out.flush(); os.fsync(out.fileno()); out.close()"
    ),
    "dcpkit to-torch": "dcpkit.convert.torch_save.to_torch(CKPT, OUT + '/model.pth')",
    "dcpkit to-hf": "dcpkit.convert.hf.to_hf(CKPT, OUT + '/hf', 'llama3', ARGS)",
    "dcpkit from-hf": "dcpkit.convert.hf.from_hf(OUT + '/hf', OUT + '/from_hf', 'llama3')",
    "torch dcp_to_torch_save": (
        "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(CKPT, OUT + '/ref.pth')"
    ),
}


def bench_args(gib: float) -> Llama3Args:
    """A Llama 3 shape (dim 2048, GQA 16/8 heads, vocab 32000) with enough layers for ``gib``."""
    base = Llama3Args(
        dim=2048,
        n_layers=1,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=32000,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        max_seq_len=4096,
    )
    shapes = get_adapter("llama3").expected_shapes(base)
    per_layer = sum(_numel(s) for k, s in shapes.items() if k.startswith("layers.0.")) * 4
    rest = sum(_numel(s) for k, s in shapes.items() if not k.startswith("layers.")) * 4
    layers = max(1, round((gib * (1 << 30) - rest) / per_layer))
    return replace(base, n_layers=layers)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def make_checkpoint(path: Path, args: Llama3Args, dtype: torch.dtype = torch.float32) -> int:
    """A model-only DCP checkpoint of random tensors, written tensor by tensor."""
    shapes = get_adapter("llama3").expected_shapes(args)
    state = {k: meta_tensor(s, dtype) for k, s in shapes.items()}
    gen = torch.Generator()

    def produce(fqn, rows):
        gen.manual_seed(hash(fqn) % (2**31))
        shape = list(shapes[fqn])
        if rows is not None:
            shape[0] = rows[1] - rows[0]
        return torch.randn(shape, generator=gen).to(dtype)

    write_dcp(path, state, produce)
    return sum(p.stat().st_size for p in path.iterdir())


def run_op(code: str, ckpt: Path, out: Path, args: object) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of ``code`` in a fresh interpreter."""
    prelude = (
        f"{IMPORTS}\nfrom dcpkit.models import DeepSeekV3Args, Llama3Args, MoEArgs\n"
        f"CKPT = {str(ckpt)!r}\nOUT = {str(out)!r}\nARGS = {args!r}\n"
        "import time\nt0 = time.perf_counter()\n"
    )
    # VmHWM is the peak resident set of this process image (exec starts it afresh, unlike
    # ru_maxrss, which also counts the parent's pages shared at fork).
    script = (
        prelude
        + code
        + (
            "\nprint('WALL', time.perf_counter() - t0)\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0])\n"
        )
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark operation failed:\n{code}\n{proc.stderr[-2000:]}")
    lines = proc.stdout.splitlines()
    wall = float(next(line.split()[1] for line in lines if line.startswith("WALL")))
    hwm_kib = int(next(line.split()[1] for line in lines if line.startswith("VmHWM")))
    return wall, hwm_kib * 1024


def measure(work: Path, args: Llama3Args, label: str, dtype_name: str, settle_s: float) -> dict:
    """Every operation of ``OPS`` on a checkpoint of ``args``'s shapes, each after waiting up to
    ``settle_s`` for the host to take back the memory freed before it; prints the table."""
    from host_memory import settle
    from recovery import _evict

    ckpt = work / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    t0 = time.perf_counter()
    size = make_checkpoint(ckpt, args, getattr(torch, dtype_name))
    print(
        f"\ncheckpoint: Llama 3 {label}, {args.n_layers} layers, dim {args.dim}, vocab "
        f"{args.vocab_size}: {size / (1 << 30):.2f} GiB {dtype_name} "
        f"(written in {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    skipped = {}
    if size > 0.4 * ram:
        skipped["torch dcp_to_torch_save"] = (
            f"holds the whole {size / 2**30:.1f} GiB checkpoint in memory; this machine has "
            f"{ram / 2**30:.0f} GiB"
        )
    rows = {}
    for name, code in OPS.items():
        if name in skipped:
            print(f"  skipped {name}: {skipped[name]}", flush=True)
            continue
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        if name == "dcpkit from-hf":  # needs the to-hf output
            run_op(OPS["dcpkit to-hf"], ckpt, out, args)
        _evict(work)  # recovery.py's: fsync and drop each file's pages
        if settle_s > 0:  # every operation starts from memory the host took back
            settle(limit_s=settle_s)
        wall, rss = run_op(code, ckpt, out, args)
        rows[name] = {"wall_s": wall, "peak_rss_bytes": rss}
        print(f"  measured {name}", flush=True)
    shutil.rmtree(work / "out", ignore_errors=True)
    base = rows["baseline (imports only)"]["peak_rss_bytes"]
    raw = rows["raw read+write"]["wall_s"]
    print(
        f"\n{'operation':<26} {'wall s':>8} {'x raw':>7} {'RSS above base':>15} {'% of ckpt':>10}"
    )
    for name, r in rows.items():
        above = r["peak_rss_bytes"] - base
        r["rss_above_baseline_bytes"] = above
        r["rss_fraction_of_checkpoint"] = above / size
        r["wall_vs_raw"] = r["wall_s"] / raw
        if name.startswith("baseline"):
            print(f"{name:<26} {'':>8} {'':>7} {base / (1 << 20):>11.0f} MiB (absolute)")
            continue
        print(
            f"{name:<26} {r['wall_s']:>8.2f} {r['wall_vs_raw']:>7.2f} "
            f"{above / (1 << 20):>11.0f} MiB {100 * above / size:>9.1f}%"
        )
    return {
        "checkpoint_bytes": size,
        "dtype": dtype_name,
        "layers": args.n_layers,
        "results": rows,
        "skipped": skipped,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gb", type=float, nargs="+", default=[2.0], help="checkpoint sizes, GiB (default 2)"
    )
    parser.add_argument("--flavor", help="a Llama 3 flavor's shapes (e.g. 8B) instead of --gb")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], help="default: float32, bfloat16 with --flavor"
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--png", type=Path, help="throughput plot (default: next to --json)")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder)")
    parser.add_argument(
        "--settle",
        type=float,
        default=30.0,
        help="seconds at most to wait before each operation for the host to take back freed "
        "memory, on a machine that reports free pages (0: do not wait; default 30)",
    )
    opts = parser.parse_args()
    if opts.flavor and opts.flavor not in LLAMA3_FLAVORS:
        parser.error(f"--flavor: one of {', '.join(LLAMA3_FLAVORS)}")
    shapes = (
        [(opts.flavor, LLAMA3_FLAVORS[opts.flavor])]
        if opts.flavor
        else [("shape", bench_args(gb)) for gb in opts.gb]
    )
    dtype_name = opts.dtype or ("bfloat16" if opts.flavor else "float32")
    work = Path(tempfile.mkdtemp(prefix="dcpkit-bench-", dir=opts.workdir))
    try:
        sizes = [measure(work, args, label, dtype_name, opts.settle) for label, args in shapes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if opts.json:
        data = {"flavor": opts.flavor, "sizes": sizes}
        opts.json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"\nwrote {opts.json}")
    png = opts.png or (opts.json.with_suffix(".png") if opts.json else None)
    if png:
        _plot(sizes, opts.flavor, png)
        print(f"wrote {png}")
    return 0


def _plot(sizes: list[dict], flavor: str | None, png: Path) -> None:
    """GiB/s of each conversion (the checkpoint's bytes over its wall time) against the
    checkpoint's size, beside the raw read+write of the same bytes."""
    from _plot import throughput_png

    def series(name: str) -> tuple[str, list[tuple[float, float]]]:
        points = []
        for entry in sizes:
            gib = entry["checkpoint_bytes"] / (1 << 30)
            if name in entry["results"]:
                points.append((gib, gib / entry["results"][name]["wall_s"]))
        return name, points

    ops = [n for n in OPS if not n.startswith(("baseline", "raw"))]
    pairs = [(series(ops[0]), series("raw read+write"))]
    pairs += [(series(name), None) for name in ops[1:] if series(name)[1]]
    what = f"Llama 3 {flavor}" if flavor else "Llama 3 shapes"
    throughput_png(png, f"Conversions vs a raw read + write: {what}", {"conversions": pairs})


if __name__ == "__main__":
    sys.exit(main())
