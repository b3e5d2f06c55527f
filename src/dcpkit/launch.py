"""Launching the reference trainer under torchrun (used by ``dcpkit train`` and the demo)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable


def torchrun_command(nproc: int, args: list[str], module: str = "dcpkit.train") -> list[str]:
    """``torchrun --standalone --nproc-per-node N -m MODULE ARGS`` with this interpreter."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        module,
        *args,
    ]


def check_train_args(nproc: int, args: list[str]) -> None:
    """The trainer's options checked in the launcher, before any rank starts: a configuration
    error is said once (a ``ConfigError``), not by every rank and then by torchrun's report."""
    from dcpkit.train.config import load_config
    from dcpkit.train.parallelize import mesh_layout

    mesh_layout(load_config(args).parallelism, nproc)


def torchrun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a launch: one thread per rank unless the user set it (the same
    thread count keeps runs bitwise reproducible), unbuffered output, quiet torchrun."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("LOGLEVEL", "ERROR")
    env.update(extra or {})
    return env


def run_training(
    nproc: int,
    args: list[str],
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Run the trainer; each output line goes to ``on_line`` (default: printed). Returns the
    exit code."""
    proc = subprocess.Popen(
        torchrun_command(nproc, args),
        env=torchrun_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        (on_line or (lambda s: print(s, end="")))(line)
    return proc.wait()
