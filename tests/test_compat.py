"""Checkpoints written by earlier dcpkit releases load, bitwise, at any world size.

``tests/data/v0.1`` was written by dcpkit 0.1.0 (``tests/scripts/write_v01_checkpoint.py``, 2
ranks under FSDP2): a full checkpoint at step 2 (model, optimizer, lr scheduler, dataloader,
train state, per-rank RNG) and a model-only last save at step 3, with the values a load must
restore."""

from __future__ import annotations

import shutil

import pytest

from conftest import ROOT, run_script
from dcpkit.cli import main as cli_main

V01 = ROOT / "tests" / "data" / "v0.1"


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [1, 2])
def test_v01_checkpoint_restores_everything(tmp_path, nproc):
    copy = tmp_path / "v0.1"
    shutil.copytree(V01, copy)
    proc = run_script(nproc, "load_v01_checkpoint.py", str(copy))
    assert f"restored at world size {nproc}: OK" in proc.stdout


@pytest.mark.parametrize("step", [2, 3])
def test_v01_checkpoint_verifies(step, capsys):
    assert cli_main(["verify", str(V01 / "checkpoint" / f"step-{step}")]) == 0
    assert "OK:" in capsys.readouterr().out
