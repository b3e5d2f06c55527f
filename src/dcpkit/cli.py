"""``dcpkit``: one command, subcommands over library functions.

Errors print one paragraph and exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from dcpkit import __version__


class CLIError(Exception):
    """An error for the person at the terminal: what, why, how to fix."""


def _cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.launch import torchrun_command, torchrun_env

    return subprocess.call(torchrun_command(args.nproc_per_node, rest), env=torchrun_env())


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.0f}h"
    return f"{seconds / 86400:.0f}d"


def _cmd_list(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit import layout

    folder = Path(args.folder)
    if not folder.exists():
        raise CLIError(
            f"{folder} does not exist; pass a checkpoint folder (the one holding step-N)"
        )
    if not folder.is_dir():
        raise CLIError(f"{folder} is not a folder; pass the folder that holds step-N checkpoints")
    rows = layout.describe_folder(folder)
    if not rows:
        print(f"{folder}: no checkpoints")
        return 0
    now = time.time()
    print(f"{'checkpoint':<18} {'step':>8} {'size':>10} {'age':>6}  status")
    for row in rows:
        step = "" if row.step is None else str(row.step)
        print(
            f"{row.name:<18} {step:>8} {_human_bytes(row.size):>10} "
            f"{_human_age(now - row.mtime):>6}  {row.status}"
        )
    return 0


def _report(result, verb: str) -> None:  # type: ignore[no-untyped-def]
    print(
        f"{verb}: {result.tensors} tensors, {_human_bytes(result.bytes)} -> {result.output} "
        f"in {result.seconds:.1f}s"
    )
    if result.flavor:
        print(f"  flavor: {result.flavor}")
    for key, why in result.dropped:
        print(f"  dropped {key}: {why}")
    if result.max_tensor_diff is not None:
        print(
            f"  verified: every tensor read back matches; max abs diff vs source "
            f"{result.max_tensor_diff:.3g}"
        )
    if result.max_logits_diff is not None:
        print(
            f"  verified: transformers logits match dcpkit's model, max abs diff "
            f"{result.max_logits_diff:.3g}"
        )
    for note in result.notes:
        print(f"  note: {note}")


def _budget(args: argparse.Namespace) -> int:
    from dcpkit.convert.safetensors_io import parse_size

    return parse_size(args.memory_budget)


def _cmd_to_torch(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.convert.torch_save import to_torch

    result = to_torch(
        args.ckpt, args.out, model_only=args.model_only, force=args.force, budget=_budget(args)
    )
    _report(result, "to-torch")
    return 0


def _cmd_from_torch(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.convert.torch_save import from_torch

    _report(from_torch(args.pth, args.ckpt, force=args.force, budget=_budget(args)), "from-torch")
    return 0


def _cmd_to_hf(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.convert.common import parse_dtype
    from dcpkit.convert.hf import to_hf

    ckpt = args.ckpt or args.ckpt_path
    out = args.out or args.output_path
    if not ckpt or not out:
        raise CLIError(
            "to-hf needs a checkpoint and an output folder: dcpkit to-hf CKPT OUT_DIR "
            "--model llama3 --flavor 8B"
        )
    if not args.flavor:
        raise CLIError(
            "to-hf needs --flavor (e.g. --flavor 8B): head counts cannot be read "
            "from the tensors' shapes"
        )
    result = to_hf(
        ckpt,
        out,
        args.model,
        args.flavor,
        tokenizer=args.tokenizer,
        dtype=parse_dtype(args.dtype),
        max_shard_size=args.max_shard_size,
        verify=args.verify,
        force=args.force,
        budget=_budget(args),
    )
    _report(result, "to-hf")
    return 0


def _cmd_from_hf(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.convert.common import parse_dtype
    from dcpkit.convert.hf import from_hf

    result = from_hf(
        args.hf_dir,
        args.ckpt,
        args.model,
        flavor=args.flavor,
        dtype=parse_dtype(args.dtype),
        verify=args.verify,
        force=args.force,
        budget=_budget(args),
    )
    _report(result, "from-hf")
    return 0


def _add_common_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true", help="replace an existing output")
    p.add_argument(
        "--memory-budget",
        default="256MiB",
        metavar="SIZE",
        help="tensor bytes held at once; larger tensors move in row blocks (default 256MiB)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dcpkit",
        description="Checkpointing for PyTorch distributed training.",
    )
    parser.add_argument("--version", action="version", version=f"dcpkit {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "train",
        help="run the reference trainer under torchrun",
        description="Launch torchrun with N processes running `python -m dcpkit.train`. Every "
        "other argument is passed on: --job.config_file FILE and --section.option VALUE.",
    )
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N")
    p.set_defaults(func=_cmd_train, passthrough=True)

    p = sub.add_parser("to-torch", help="DCP checkpoint -> one torch.save file (streaming)")
    p.add_argument("ckpt", help="a DCP checkpoint folder (step-N)")
    p.add_argument("out", help="the .pth file to write")
    p.add_argument(
        "--model-only",
        action="store_true",
        help="the model's parameters only, ready for model.load_state_dict",
    )
    _add_common_convert(p)
    p.set_defaults(func=_cmd_to_torch, passthrough=False)

    p = sub.add_parser("from-torch", help="one torch.save file -> DCP checkpoint (streaming)")
    p.add_argument("pth", help="a torch.save file holding a dict of tensors")
    p.add_argument("ckpt", help="the DCP checkpoint folder to write")
    _add_common_convert(p)
    p.set_defaults(func=_cmd_from_torch, passthrough=False)

    from dcpkit.convert.adapters import known_families

    p = sub.add_parser("to-hf", help="DCP checkpoint -> Hugging Face safetensors folder")
    p.add_argument("ckpt", nargs="?", help="a DCP checkpoint folder (step-N)")
    p.add_argument("out", nargs="?", help="the folder to write")
    p.add_argument("--ckpt_path", "--ckpt-path", dest="ckpt_path", help=argparse.SUPPRESS)
    p.add_argument("--output_path", "--output-path", dest="output_path", help=argparse.SUPPRESS)
    p.add_argument(
        "--model",
        "--model_name",
        "--model-name",
        dest="model",
        default="llama3",
        choices=known_families(),
        help="model family (default llama3)",
    )
    p.add_argument("--flavor", help="model flavor, e.g. debugmodel or 8B")
    p.add_argument(
        "--tokenizer",
        "--tokenizer_path",
        "--tokenizer-path",
        dest="tokenizer",
        help="tokenizer.json (or a folder of tokenizer files) to ship with the model",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="cast floating tensors (default: keep the checkpoint's dtype)",
    )
    p.add_argument("--max-shard-size", "--max_shard_size", default="5GB", metavar="SIZE")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every tensor back and compare logits with transformers",
    )
    _add_common_convert(p)
    p.set_defaults(func=_cmd_to_hf, passthrough=False)

    p = sub.add_parser("from-hf", help="Hugging Face safetensors folder -> DCP checkpoint")
    p.add_argument("hf_dir", help="a folder written by save_pretrained (or a .safetensors file)")
    p.add_argument("ckpt", help="the DCP checkpoint folder to write")
    p.add_argument(
        "--model",
        "--model_name",
        dest="model",
        default="llama3",
        choices=known_families(),
        help="model family (default llama3)",
    )
    p.add_argument("--flavor", help="model flavor (default: inferred from config.json)")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="cast floating tensors (default: keep the folder's dtype)",
    )
    p.add_argument("--verify", action="store_true", help="read every tensor back and compare")
    _add_common_convert(p)
    p.set_defaults(func=_cmd_from_hf, passthrough=False)

    p = sub.add_parser("list", help="checkpoints under a checkpoint folder, with their status")
    p.add_argument("folder")
    p.set_defaults(func=_cmd_list, passthrough=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"dcpkit {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
