"""MoE conversion benchmark: a DeepSeek-V3-shaped checkpoint at real width (dim 7168, 128 heads,
latent ranks 1536/512, expert width 2048, dense width 18432) with a few layers, converted
``to-hf``, ``from-hf`` and ``from-hf`` from FP8 with 128x128 block scales (as DeepSeek
publishes its weights), each in its own process: wall time beside a raw read+write of the same
bytes, and peak RSS beside the bound that matters, the largest stacked expert tensor + 256 MiB.

    python benchmarks/moe_convert.py [--experts 16] [--vocab 129280] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import OPS as RAW_OPS
from convert import run_op

from dcpkit.convert.adapters import ExpertOf, get_adapter
from dcpkit.formats.dcp import meta_tensor, write_dcp
from dcpkit.formats.safetensors import SafetensorsWriter
from dcpkit.models.deepseek_v3 import DeepSeekV3Args

BUDGET = 256 << 20
OPS = {
    # The baseline and the raw read+write, as the dense benchmark measures them.
    **{k: RAW_OPS[k] for k in ("baseline (imports only)", "raw read+write")},
    "dcpkit to-hf": "dcpkit.convert.hf.to_hf(CKPT, OUT + '/hf', 'deepseek_v3', ARGS)",
    "dcpkit from-hf": "dcpkit.convert.hf.from_hf(CKPT + '/../hf', OUT + '/dcp', 'deepseek_v3')",
    "dcpkit from-hf (FP8 source)": (
        "dcpkit.convert.hf.from_hf(CKPT + '/../fp8', OUT + '/dcp', 'deepseek_v3')"
    ),
}


def bench_args(experts: int, vocab: int, small: bool) -> DeepSeekV3Args:
    """Published DeepSeek-V3 widths, one dense and one MoE layer of ``experts`` experts."""
    args = replace(
        DeepSeekV3Args(),
        n_layers=2,
        n_dense_layers=1,
        vocab_size=vocab,
        moe=replace(
            DeepSeekV3Args().moe,
            num_experts=experts,
            num_expert_groups=None,
            num_limited_groups=None,
            top_k=min(8, experts),
        ),
    )
    if small:  # for the test: the same structure at debug widths
        args = replace(
            args,
            dim=256,
            n_heads=8,
            q_lora_rank=256,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            hidden_dim=768,
            moe=replace(args.moe, hidden_dim=512),
        )
    return args


def _random(shape, rows, seed: int) -> torch.Tensor:
    shape = list(shape)
    if rows is not None:
        shape[0] = rows[1] - rows[0]
        seed += rows[0]
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def make_checkpoint(path: Path, args: DeepSeekV3Args) -> int:
    """A model-only bf16 DCP checkpoint of random tensors, a block at a time."""
    shapes = get_adapter("deepseek_v3").expected_shapes(args)
    state = {k: meta_tensor(s, torch.bfloat16) for k, s in shapes.items()}
    seeds = {k: i * 100003 for i, k in enumerate(sorted(shapes))}
    write_dcp(
        path,
        state,
        lambda fqn, rows: _random(shapes[fqn], rows, seeds[fqn]).to(torch.bfloat16),
        max_chunk_bytes=BUDGET,
    )
    return sum(p.stat().st_size for p in path.iterdir())


def make_fp8_folder(path: Path, args: DeepSeekV3Args) -> int:
    """The same model as a published-style HF folder: 2-D projection weights in FP8 (e4m3) with
    128x128 ``weight_scale_inv`` blocks, the rest bf16, one tensor per expert."""
    adapter = get_adapter("deepseek_v3")
    shapes = adapter.expected_shapes(args)
    plan = adapter.plan_to_hf(shapes, args, "bench", "bench")
    entries, sources = [], {}
    for canon, hf, tf in plan.pairs:
        shape = shapes[canon][1:] if isinstance(tf, ExpertOf) else shapes[canon]
        fp8 = len(shape) == 2 and hf.endswith("proj.weight") and "embed" not in hf
        sources[hf] = (shape, fp8)
        entries.append((hf, shape, torch.float8_e4m3fn if fp8 else torch.bfloat16))
        if fp8:
            scale = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
            entries.append((hf + "_scale_inv", scale, torch.float32))
    path.mkdir(parents=True)
    writer = SafetensorsWriter(path, entries, 4 << 30)
    for i, (hf, (shape, fp8)) in enumerate(sources.items()):
        step = max(128, BUDGET // (4 * max(1, math.prod(shape[1:]))) // 128 * 128)
        for a in range(0, shape[0], step):
            rows = (a, min(a + step, shape[0]))
            t = _random(shape, rows, i * 7919)
            writer.write(hf, t.clamp(-448, 448).to(torch.float8_e4m3fn) if fp8 else t, rows)
        if fp8:
            g = torch.Generator().manual_seed(i)
            scale = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
            writer.write(hf + "_scale_inv", torch.rand(scale, generator=g) * 1e-3 + 1e-4)
    writer.close()
    config = adapter.hf_config(args, torch.bfloat16, None, None)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return sum(p.stat().st_size for p in path.iterdir())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=16, help="experts per MoE layer")
    parser.add_argument("--vocab", type=int, default=129280, help="vocabulary size")
    parser.add_argument("--small", action="store_true", help="debug widths (for the test)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder)")
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dcpkit-moe-bench-", dir=opts.workdir))
    try:
        args = bench_args(opts.experts, opts.vocab, opts.small)
        ckpt = work / "ckpt"
        t0 = time.perf_counter()
        size = make_checkpoint(ckpt, args)
        fp8_size = make_fp8_folder(work / "fp8", args)
        m = args.moe
        stacked = m.num_experts * m.hidden_dim * args.dim * 2  # one bf16 [E, hidden, dim]
        print(
            f"checkpoint: DeepSeek-V3 widths (dim {args.dim}, {args.n_heads} heads, expert "
            f"width {m.hidden_dim}), {args.n_layers} layers ({args.n_dense_layers} dense), "
            f"{m.num_experts} experts, vocab {args.vocab_size}: {size / (1 << 30):.2f} GiB bf16; "
            f"FP8 folder {fp8_size / (1 << 30):.2f} GiB (written in "
            f"{time.perf_counter() - t0:.0f}s); largest stacked expert tensor "
            f"{stacked / (1 << 20):.0f} MiB"
        )
        rows = {}
        for name, code in OPS.items():
            out = work / "out"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            os.sync()  # no operation pays for the previous one's writeback
            wall, rss = run_op(code, ckpt, out, args)
            rows[name] = {"wall_s": wall, "peak_rss_bytes": rss}
            if name == "dcpkit to-hf":  # the from-hf source, kept for the next operation
                shutil.move(out / "hf", work / "hf")
            print(f"  measured {name}", flush=True)
        base = rows["baseline (imports only)"]["peak_rss_bytes"]
        raw = rows["raw read+write"]["wall_s"]
        bound = stacked + BUDGET
        print(
            f"\n{'operation':<28} {'wall s':>7} {'x raw':>6} {'RSS above base':>15} {'bound':>10}"
        )
        for name, r in rows.items():
            above = r["peak_rss_bytes"] - base
            r["rss_above_baseline_bytes"] = above
            r["wall_vs_raw"] = r["wall_s"] / raw
            if name.startswith("baseline"):
                print(f"{name:<28} {'':>7} {'':>6} {base / (1 << 20):>11.0f} MiB (absolute)")
                continue
            print(
                f"{name:<28} {r['wall_s']:>7.2f} {r['wall_vs_raw']:>6.2f} "
                f"{above / (1 << 20):>11.0f} MiB {bound / (1 << 20):>6.0f} MiB"
            )
        print("\nbound: largest stacked expert tensor + the 256 MiB budget")
        if opts.json:
            summary = {
                "checkpoint_bytes": size,
                "fp8_folder_bytes": fp8_size,
                "largest_stacked_expert_bytes": stacked,
                "rss_bound_bytes": bound,
                "args": {"dim": args.dim, "experts": m.num_experts, "vocab": args.vocab_size},
                "results": rows,
            }
            opts.json.write_text(json.dumps(summary, indent=2) + "\n")
            print(f"wrote {opts.json}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
