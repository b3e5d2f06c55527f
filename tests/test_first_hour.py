"""A newcomer's first hour: what the README's loop does with the first things a user passes.
A plain DataLoader is refused when the manager is built (not after training), a URL as the base
folder saves to the object store, a TOML file whose options lie outside ``[checkpoint]`` is
refused naming it, and a loop that configured no logging still sees one line per save and load.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from conftest import BUCKET, ROOT, cli
from dcpkit import CheckpointConfig, CheckpointManager, ConfigError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_plain_dataloader_is_refused_when_the_manager_is_built(tmp_path):
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)
    with pytest.raises(TypeError) as e:
        CheckpointManager(
            CheckpointConfig(enable=True), tmp_path, torch.nn.Linear(2, 2), dataloader=loader
        )
    text = str(e.value)
    assert "DataLoader" in text and "StatefulDataLoader" in text and "state_dict" in text
    assert not (tmp_path / "checkpoint").exists()  # refused before anything was written


def test_a_url_as_the_base_folder_saves_to_the_object_store(s3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = f"s3://{BUCKET}/first-hour-{uuid.uuid4().hex}"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    with CheckpointManager(CheckpointConfig(enable=True, interval=1), run, model) as mgr:
        assert mgr.folder == f"{run}/checkpoint"
        mgr.save(1)
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())  # nothing written locally
    listed = cli("list", f"{run}/checkpoint")
    assert listed.returncode == 0 and "step-1" in listed.stdout, listed.stdout + listed.stderr
    torch.manual_seed(1)
    other = torch.nn.Linear(4, 4)
    with CheckpointManager(CheckpointConfig(enable=True), run, other) as mgr:
        assert mgr.load() == 1
    assert torch.equal(other.weight, model.weight)


def test_from_toml_refuses_options_outside_the_checkpoint_table(tmp_path):
    path = tmp_path / "train.toml"
    path.write_text("enable = true\ninterval = 5\n")
    with pytest.raises(ConfigError, match=rf"{path}: enable, interval lie outside any table"):
        CheckpointConfig.from_toml(path)
    path.write_text('[job]\ndump_folder = "out"\n')
    with pytest.raises(ConfigError, match=rf"{path} has no \[checkpoint\] table"):
        CheckpointConfig.from_toml(path)
    path.write_text('[job]\ndump_folder = "out"\n[checkpoint]\nenable = true\ninterval = 5\n')
    assert CheckpointConfig.from_toml(path).interval == 5


LOOP = """
import logging, sys, torch
from dcpkit import CheckpointConfig, CheckpointManager
{setup}
model = torch.nn.Linear(4, 4)
cfg = CheckpointConfig(enable=True, interval=1)
with CheckpointManager(cfg, sys.argv[1], model) as mgr:
    mgr.load()
    mgr.save(1)
with CheckpointManager(cfg, sys.argv[1], model) as mgr:
    mgr.load()
"""


@pytest.mark.parametrize(
    "setup,expected",
    [
        ("", 1),  # no logging configured: dcpkit prints its lines
        ("logging.basicConfig(level=logging.INFO)", 1),  # configured: logged once, not twice
        ('logging.getLogger("dcpkit").setLevel(logging.WARNING)', 0),  # turned off
    ],
    ids=["unconfigured", "configured", "off"],
)
def test_a_users_loop_sees_a_line_per_save_and_load(tmp_path, setup, expected):
    script = tmp_path / "loop.py"
    script.write_text(textwrap.dedent(LOOP.format(setup=setup)))
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "run")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert out.count("checkpoint: saved step 1 to ") == expected, out
    assert out.count("starting fresh") == expected, out
    assert out.count("checkpoint: loaded ") == expected, out
