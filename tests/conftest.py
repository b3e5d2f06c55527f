"""Shared fixtures: torchrun launches of the reference trainer, reused across tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as torch_dist

from dcpkit.launch import torchrun_command

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "llama3_debugmodel.toml"


def torchrun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # bitwise determinism needs the same thread count everywhere
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = "ERROR"
    env.pop("DCPKIT_FAILPOINT", None)
    env.update(extra or {})
    return env


def run_train(
    nproc: int,
    dump: Path,
    *overrides: str,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: int = 300,
) -> subprocess.CompletedProcess:
    """The reference trainer under torchrun, as a user runs it."""
    cmd = torchrun_command(
        nproc, ["--job.config_file", str(CONFIG), "--job.dump_folder", str(dump), *overrides]
    )
    proc = subprocess.run(
        cmd, env=torchrun_env(env), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def run_script(
    nproc: int, script: str, *args: str, timeout: int = 300
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(ROOT / "tests" / "scripts" / script),
        *args,
    ]
    proc = subprocess.run(cmd, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(dump: Path) -> dict[int, dict]:
    """Per step, the last record written (a resumed run rewrites the steps after its checkpoint)."""
    records: dict[int, dict] = {}
    with open(dump / "metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            records[rec["step"]] = rec
    return records


def copy_checkpoint(src_dump: Path, step: int, dst_dump: Path) -> None:
    dst = dst_dump / "checkpoint" / f"step-{step}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src_dump / "checkpoint" / f"step-{step}", dst)


@pytest.fixture
def process_group():
    """A one-process gloo group, for code under test that needs one in this process."""
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    yield
    torch_dist.destroy_process_group()


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """2 ranks, 20 steps, checkpoints every 5 steps."""
    dump = tmp_path_factory.mktemp("reference")
    run_train(2, dump)
    return dump


@pytest.fixture(scope="session")
def stopped_run(tmp_path_factory) -> Path:
    """The same run, stopped after step 10 (a full checkpoint is written there)."""
    dump = tmp_path_factory.mktemp("stopped")
    run_train(2, dump, "--training.stop_at_step", "10")
    return dump
