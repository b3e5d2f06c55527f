"""``dcpkit``: one command, subcommands over library functions.

Errors print one paragraph and exit non-zero; ``--debug`` shows the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from dcpkit import __version__
from dcpkit.errors import CLIError, describe_error
from dcpkit.layout import DTYPES, parse_dtype
from dcpkit.push.command import add_push
from dcpkit.units import parse_size


def _cmd_train(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.launch import check_train_args, torchrun_command, torchrun_env

    check_train_args(args.nproc_per_node, rest)
    return subprocess.call(torchrun_command(args.nproc_per_node, rest), env=torchrun_env())


def _tool(module: str):
    """The command of ``dcpkit.tools.<module>`` (its ``command(args)``), imported when run."""

    def run(args: argparse.Namespace, rest: list[str]) -> int:
        return importlib.import_module(f"dcpkit.tools.{module}").command(args)

    return run


def _cmd_inspect(args: argparse.Namespace, rest: list[str]) -> int:
    import json

    from dcpkit.tools.inspect import format_inspect, inspect_path

    info = inspect_path(args.path, trust_pickle=args.trust_pickle, step=args.step)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_inspect(info, limit=None if args.all else 60))
    return 1 if info["problems"] else 0


def _cmd_verify(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.tools.verify import report_lines, verify_path

    report = verify_path(args.path, checksums=not args.quick, step=args.step)
    print("\n".join(report_lines(report)))
    return 0 if report.ok else 1


def _cmd_diff(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.tools.diff import diff_lines, diff_paths

    result = diff_paths(
        args.a, args.b, family=args.model, budget=_budget(args), trust_pickle=args.trust_pickle
    )
    print("\n".join(diff_lines(result, args.atol)))
    return 0 if result.same(args.atol) else 1


def _report(result, verb: str) -> None:  # type: ignore[no-untyped-def]
    print("\n".join(result.lines(verb)))


def _budget(args: argparse.Namespace) -> int:
    return parse_size(args.memory_budget)


def _cmd_to_torch(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.convert.torch_save import to_torch

    result = to_torch(
        args.ckpt,
        args.out,
        model_only=args.model_only,
        force=args.force,
        budget=_budget(args),
        step=args.step,
    )
    _report(result, "to-torch")
    return 0


def _cmd_from_torch(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.convert.torch_save import from_torch

    result = from_torch(
        args.pth, args.ckpt, force=args.force, budget=_budget(args), trust_pickle=args.trust_pickle
    )
    _report(result, "from-torch")
    return 0


def _cmd_to_hf(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.convert.hf import to_hf

    ckpt = args.ckpt or args.ckpt_path
    out = args.out or args.output_path
    if not ckpt or not out:
        raise CLIError(
            "to-hf needs a checkpoint and an output folder: dcpkit to-hf CKPT OUT_DIR "
            "--model llama3 --flavor 8B"
        )
    if args.config and args.flavor:
        raise CLIError("to-hf takes --flavor or --config (the model's config.json), not both")
    options = dict(
        family=args.model,
        flavor=args.config or args.flavor,
        tokenizer=args.tokenizer,
        dtype=parse_dtype(args.dtype),
        max_shard_size=args.max_shard_size,
        verify=args.verify,
        force=args.force,
        budget=_budget(args),
        merge=args.merge,
    )
    if args.follow:
        from dcpkit.convert.hf_follow import to_hf_following

        if args.step is not None:
            raise CLIError("to-hf --follow exports every step as it comes: no --step with it")
        done = to_hf_following(
            ckpt, out, poll_s=args.poll, on_result=lambda name, r: _report(r, "to-hf"), **options
        )
        print(f"to-hf --follow: {len(done)} step(s) exported into {out}")
        return 0
    _report(to_hf(ckpt, out, step=args.step, **options), "to-hf")
    return 0


def _cmd_from_hf(args: argparse.Namespace, rest: list[str]) -> int:
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


def _add_model(p: argparse.ArgumentParser, flavor_help: str) -> None:
    from dcpkit.convert.adapters import known_families

    p.add_argument(
        "--model",
        "--model_name",
        "--model-name",
        dest="model",
        choices=known_families(),
        help="model family (default: inferred from config.json or the parameter names)",
    )
    p.add_argument("--flavor", help=flavor_help)


def _add_dtype(p: argparse.ArgumentParser, whose: str) -> None:
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        help=f"cast floating tensors (default: keep the {whose} dtype)",
    )


def _add_trust_pickle(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-pickle",
        action="store_true",
        help="let a torch.save file name Python objects other than tensors and plain values: "
        "their code runs, so only for a file you wrote yourself",
    )


def _add_step(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step",
        metavar="N|latest",
        help="the checkpoint path is a checkpoint folder: read its step N, or `latest` (the "
        "newest published step that verifies; PATH/latest says the same); held against the "
        "run's retention while read",
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
    _add_step(p)
    p.set_defaults(func=_cmd_to_torch, passthrough=False)

    p = sub.add_parser("from-torch", help="one torch.save file -> DCP checkpoint (streaming)")
    p.add_argument("pth", help="a torch.save file holding a dict of tensors")
    p.add_argument("ckpt", help="the DCP checkpoint folder to write")
    _add_common_convert(p)
    _add_trust_pickle(p)
    p.set_defaults(func=_cmd_from_torch, passthrough=False)

    from dcpkit.convert.adapters import known_families

    p = sub.add_parser("to-hf", help="DCP checkpoint -> Hugging Face safetensors folder")
    p.add_argument("ckpt", nargs="?", help="a DCP checkpoint folder (step-N)")
    p.add_argument("out", nargs="?", help="the folder to write")
    p.add_argument("--ckpt_path", "--ckpt-path", dest="ckpt_path", help=argparse.SUPPRESS)
    p.add_argument("--output_path", "--output-path", dest="output_path", help=argparse.SUPPRESS)
    _add_model(p, "model flavor, e.g. debugmodel or 8B")
    p.add_argument(
        "--config",
        help="the model's config.json (its args, instead of --flavor; with --model hf, "
        "written with the export)",
    )
    p.add_argument(
        "--tokenizer",
        "--tokenizer_path",
        "--tokenizer-path",
        dest="tokenizer",
        help="tokenizer to ship with the model: tokenizer.json, a folder of tokenizer files, or "
        "a tokenizer.model (Llama 3's tiktoken or SentencePiece), converted to tokenizer.json",
    )
    _add_dtype(p, "checkpoint's")
    p.add_argument("--max-shard-size", "--max_shard_size", default="5GB", metavar="SIZE")
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every tensor back and compare logits with transformers",
    )
    p.add_argument(
        "--merge", action="store_true", help="a PEFT step: the base with its adapters merged in"
    )
    _add_common_convert(p)
    _add_step(p)
    p.add_argument(
        "--follow",
        action="store_true",
        help="CKPT is the checkpoint folder of a run: export each step as the run publishes it, "
        "into OUT/step-N, until the run finishes (the steps not yet exported are held against "
        "its retention)",
    )
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_to_hf, passthrough=False)

    add_push(sub, _add_model, _add_step)

    p = sub.add_parser("from-hf", help="Hugging Face safetensors folder -> DCP checkpoint")
    p.add_argument("hf_dir", help="a folder written by save_pretrained (or a .safetensors file)")
    p.add_argument("ckpt", help="the DCP checkpoint folder to write")
    _add_model(p, "model flavor (default: inferred from config.json)")
    _add_dtype(p, "folder's")
    p.add_argument("--verify", action="store_true", help="read every tensor back and compare")
    _add_common_convert(p)
    p.set_defaults(func=_cmd_from_hf, passthrough=False)

    p = sub.add_parser("inspect", help="what a checkpoint holds (DCP, HF or torch.save)")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output (stable)")
    p.add_argument("--all", action="store_true", help="list every tensor")
    _add_trust_pickle(p)
    _add_step(p)
    p.set_defaults(func=_cmd_inspect, passthrough=False)

    p = sub.add_parser("verify", help="recompute checksums and check structure; exit 1 if bad")
    p.add_argument("path")
    p.add_argument("--quick", action="store_true", help="sizes and structure only, no checksums")
    _add_step(p)
    p.set_defaults(func=_cmd_verify, passthrough=False)

    p = sub.add_parser("diff", help="compare two checkpoints tensor by tensor (across formats)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="tolerated max abs difference")
    _add_trust_pickle(p)
    p.add_argument(
        "--model",
        choices=known_families(),
        help="family for mapping a Hugging Face folder (default: inferred from the checkpoint's "
        "parameter names and config.json)",
    )
    p.add_argument("--memory-budget", default="256MiB", metavar="SIZE", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_diff, passthrough=False)

    p = sub.add_parser("list", help="checkpoints under a checkpoint folder, with their status")
    p.add_argument("folder")
    p.add_argument(
        "--checksums",
        action="store_true",
        help="also recompute checksums (default: sizes and structure)",
    )
    p.add_argument(
        "--local-folder",
        "--local_folder",
        dest="local_folder",
        help="the run's memory-tier folder, when not the default (/dev/shm/dcpkit-<hash>)",
    )
    p.set_defaults(func=_tool("listing"), passthrough=False)

    p = sub.add_parser("prune", help="delete the steps a run's retention kept for readers now gone")
    p.add_argument("folder", help="a checkpoint folder (or a run's folder), path or URL")
    p.set_defaults(func=_tool("prune"), passthrough=False)

    p = sub.add_parser("plot", help="loss, lr and checkpoint stall of runs, overlaid, as a PNG")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run's dump folder (metrics.jsonl)")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png")
    p.add_argument("--names", nargs="+", metavar="NAME", help="legend names, one per run")
    p.set_defaults(func=_tool("plot"), passthrough=False)

    p = sub.add_parser("report", help="a self-contained HTML page about a run")
    p.add_argument("run", help="the run's dump folder (metrics.jsonl, checkpoint folder)")
    p.add_argument("-o", "--output", required=True, metavar="FILE.html")
    p.add_argument(
        "--compare", nargs="+", default=[], metavar="RUN", help="runs to overlay on its plot"
    )
    p.add_argument(
        "--quick", action="store_true", help="check checkpoints' sizes and structure, no checksums"
    )
    p.set_defaults(func=_tool("report"), passthrough=False)
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
        print(f"dcpkit {args.command}: error: {describe_error(e)}", file=sys.stderr)
        return 2
    except BaseException as e:  # torch.distributed.checkpoint wraps failures in a BaseException
        from dcpkit.errors import first_failure

        inner = first_failure(e)
        if args.debug or inner is e:
            raise
        print(f"dcpkit {args.command}: error: {describe_error(inner)}", file=sys.stderr)  # type: ignore[arg-type]
        return 2


if __name__ == "__main__":
    sys.exit(main())
