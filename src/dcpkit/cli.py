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
