"""``dcpkit push``: the command line of ``push.checkpoint``."""

from __future__ import annotations

import argparse
from typing import Any


def _cmd_push(args: argparse.Namespace, rest: list[str]) -> int:
    from dcpkit.push.checkpoint import push_checkpoint, push_following

    options: dict[str, Any] = dict(
        family=args.model, flavor=args.config or args.flavor, bucket_size=args.bucket_size,
        timeout_s=args.timeout, host=args.host,
    )  # fmt: skip
    if args.config and args.flavor:
        raise ValueError("push takes --flavor or --config (the model's config.json), not both")

    def said(name: str, r: Any) -> None:
        print(f"push: {name} -> {r.engine}: version {r.version}, {r.tensors} tensors, "
              f"{r.bytes / 1e6:.1f} MB in {r.buckets} buckets, {r.seconds:.2f} s "
              f"({r.gb_per_s:.2f} GB/s)", flush=True)  # fmt: skip

    if args.follow:
        if args.step is not None:
            raise ValueError("push --follow pushes every step as it comes: no --step with it")
        done = push_following(args.ckpt, args.engine, poll_s=args.poll, wait_s=args.wait,
                              on_result=said, **options)  # fmt: skip
        print(f"push --follow: {len(done)} step(s) pushed into {args.engine}")
        return 0
    said(str(args.ckpt), push_checkpoint(args.ckpt, args.engine, step=args.step,
                                         version=args.version, **options))  # fmt: skip
    return 0


def add_push(sub: Any, add_model: Any, add_step: Any) -> None:
    """The ``push`` subcommand on ``sub`` (``add_model``/``add_step``: the shared options)."""
    p = sub.add_parser("push", help="a checkpoint's weights into a running vLLM server")
    p.add_argument("ckpt", help="a step folder (or URL); with --step or --follow, a checkpoint "
                   "folder")  # fmt: skip
    p.add_argument("engine", help="the vLLM server, http://HOST:PORT (started with "
                   "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                   "'{\"backend\": \"dcpkit_gloo\"}')")  # fmt: skip
    add_model(p, "model flavor, when the step records no model (e.g. 8B)")
    p.add_argument("--config", help="the model's config.json (its args, instead of --flavor)")
    add_step(p)
    p.add_argument("--version", help="the version the engine serves it as (default: the step)")
    p.add_argument("--bucket-size", default="256MB", metavar="SIZE",
                   help="bytes sent at a time (default 256MB)")  # fmt: skip
    p.add_argument("--host", help="this machine's address the engine reaches (default: found)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="SECONDS",
                   help="how long an engine may take to answer (default 300)")  # fmt: skip
    p.add_argument("--follow", action="store_true",
                   help="CKPT is the checkpoint folder of a run: push each step as the run "
                   "publishes it, until the run finishes (held against its retention)")  # fmt: skip
    p.add_argument("--wait", type=float, metavar="SECONDS",
                   help="with --follow: give up if no run starts in that time")  # fmt: skip
    p.add_argument("--poll", type=float, default=1.0, metavar="SECONDS", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_push, passthrough=False)
