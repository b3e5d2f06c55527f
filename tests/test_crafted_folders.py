"""Crafted folders (``tests/crafted.py``): a real checkpoint whose ``.metadata`` says what its
records cannot hold, its index and manifest made to agree again. Every entry point - `dcpkit
verify`, `list`, `inspect`, `diff`, `to-torch`, `to-hf`, the manager's load with and without
checksums, Lightning's checkpoint IO - refuses each one with a ``CorruptCheckpoint`` (or a
non-zero exit) whose message names the file, the key and the rule; `verify` and `list` never
print OK for one. With and without the index of ``.metadata`` (DCP and TorchTitan write none)."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import Counter, bounded, cli, run_script
from crafted import CASES, craft, hostile_markers
from dcpkit import CheckpointConfig, CheckpointManager, CorruptCheckpoint
from dcpkit.models import build_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model():
    torch.manual_seed(0)
    return build_model("llama3", "debugmodel", max_seq_len=16)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, str]:
    """A one-process checkpoint (model, a user state, RNG) and the key the cases break: a 2-D
    tensor whose rows and columns differ (a transposed claim is then another shape)."""
    root = tmp_path_factory.mktemp("crafted") / "base"
    cfg = CheckpointConfig(enable=True, interval=1)
    with CheckpointManager(cfg, root, _model(), states={"train_state": Counter()}) as mgr:
        mgr.save(1)
    step = root / "checkpoint" / "step-1"
    md = pickle.loads((step / ".metadata").read_bytes())
    key = next(
        k
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "chunks") and len(v.size) == 2 and v.size[0] != v.size[1]
    )
    return root, key


def _copy(base: tuple[Path, str], tmp_path: Path, case, index: bool = True) -> tuple[Path, Path]:
    root, key = base
    run = tmp_path / case.name
    shutil.copytree(root, run)
    step = run / "checkpoint" / "step-1"
    craft(step, case, key, index=index)
    return run, step


def _names(text: str, file_hint: tuple[str, ...], key: str, rule: str) -> None:
    assert key in text, text
    assert rule in text, text
    assert any(f in text for f in file_hint), text


FILES = (".distcp", ".metadata")  # the data file holding the record, or .metadata (.index)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_entry_point_refuses_a_crafted_folder(base, tmp_path, case):
    _, key = base
    run, step = _copy(base, tmp_path, case)
    verdict = cli("verify", str(step))
    assert verdict.returncode == 1 and "OK" not in verdict.stdout, verdict.stdout
    _names(verdict.stdout, FILES, key, case.rule)
    listed = cli("list", str(run / "checkpoint"))
    assert listed.returncode == 1 and "CORRUPT" in listed.stdout, listed.stdout
    assert "verified" not in listed.stdout
    _names(listed.stdout, FILES, key, case.rule)
    shown = cli("inspect", str(step))
    assert shown.returncode == 1 and "problem:" in shown.stdout, shown.stdout
    for args in (
        ["diff", str(step), str(base[0] / "checkpoint" / "step-1")],
        ["to-torch", str(step), str(tmp_path / "out.pth")],
        ["to-hf", str(step), str(tmp_path / "hf"), "--flavor", "debugmodel"],
    ):
        done = cli(*args)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done)
        assert key in done.stderr and any(f in done.stderr for f in FILES), (args, done.stderr)
    assert not (tmp_path / "out.pth").exists() and not (tmp_path / "hf").exists()
    for verify in (True, False):
        cfg = CheckpointConfig(enable=True, interval=1, verify_on_load=verify)
        mgr = CheckpointManager(cfg, run, _model(), states={"train_state": Counter()})
        with mgr, pytest.raises(CorruptCheckpoint) as e:
            mgr.load()
        _names(str(e.value), FILES, key, case.rule)


def test_a_follower_names_a_crafted_step_and_exports_the_run_s_others(base, tmp_path):
    """`to-hf --follow` over a finished run whose step 1 is crafted: step 2 is exported, step 1
    is named with its key and rule, nothing of it written, and the command fails."""
    _, key = base
    case = next(c for c in CASES if c.name == "huge")
    run, _ = _copy(base, tmp_path, case)
    cfg = CheckpointConfig(enable=True, interval=1)
    with CheckpointManager(cfg, run, _model(), states={"train_state": Counter()}) as mgr:
        mgr.save(2)  # a good step after the crafted one
    out = tmp_path / "exports"
    done = cli("to-hf", str(run / "checkpoint"), str(out), "--follow", "--flavor", "debugmodel",
               "--poll", "0.2")  # fmt: skip
    assert done.returncode == 2 and "could not export 1: step-1: " in done.stderr, done
    _names(done.stderr, FILES, key, case.rule)
    assert sorted(p.name for p in out.iterdir()) == ["step-2"]
    assert "Traceback" not in done.stderr


def test_a_two_rank_load_refuses_each_crafted_folder_on_every_rank(base, tmp_path):
    """Every case loaded by a 2-rank job (a reshard of the 1-rank checkpoint), with and without
    ``verify_on_load``: each rank refuses, naming the key and the rule, none loads and none
    waits for the other. Beside them, the good checkpoint under hostile markers (every marker
    kind as a FIFO, a link to /dev/zero and a 1 GiB sparse file, one FIFO claiming step 1 is
    being deleted): both ranks load it, within the job's bound, and step 1 stays."""
    _, key = base
    runs = [_copy(base, tmp_path, case)[0] for case in CASES]
    marked = tmp_path / "markers"
    shutil.copytree(base[0], marked)
    hostile_markers(marked / "checkpoint", 1)
    proc = run_script(2, "crafted_load.py", *map(str, runs), str(marked), timeout=120)
    lines = [x.split(" ", 5) for x in proc.stdout.splitlines() if x.startswith("RANK ")]
    assert len(lines) == 2 * 2 * (len(CASES) + 1), proc.stdout[-3000:]
    loaded = [line for line in lines if line[2] == "markers"]
    assert [line[4] for line in loaded] == ["LOADED"] * 4, loaded
    assert (marked / "checkpoint" / "step-1" / "dcpkit.json").is_file()
    rules = {case.name: case.rule for case in CASES}
    for _, rank, name, verify, verdict, message in (x for x in lines if x[2] != "markers"):
        assert verdict == "REFUSED", (rank, name, verify, message)
        assert key in message and rules[name] in message, (rank, name, verify, message)


def test_exports_and_a_follower_pass_over_hostile_markers(base, tmp_path):
    """`to-hf`, `to-torch` and `to-hf --follow` of a finished run whose markers are FIFOs,
    links to /dev/zero and 1 GiB sparse files: each ends (within a minute), exports step 1
    and leaves it in place."""
    run = tmp_path / "run"
    shutil.copytree(base[0], run)
    hostile_markers(run / "checkpoint", 1)
    step = run / "checkpoint" / "step-1"
    for args in (
        ["to-hf", str(step), str(tmp_path / "hf"), "--flavor", "debugmodel"],
        ["to-torch", str(step), str(tmp_path / "out.pth")],
        ["to-hf", str(run / "checkpoint"), str(tmp_path / "followed"), "--follow",
         "--flavor", "debugmodel", "--poll", "0.2"],
    ):  # fmt: skip
        done = bounded(lambda args=args: cli(*args))
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done)
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "out.pth").is_file()
    assert sorted(p.name for p in (tmp_path / "followed").iterdir()) == ["step-1"]
    assert (step / "dcpkit.json").is_file()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_without_the_index_the_verdicts_are_the_same(base, tmp_path, case):
    """Without an index, `verify`, `list` and a load check ``.metadata`` itself, by the same
    rules."""
    _, key = base
    run, step = _copy(base, tmp_path, case, index=False)
    assert not (step / ".metadata.index").exists()
    verdict = cli("verify", str(step))
    assert verdict.returncode == 1 and "OK" not in verdict.stdout, verdict.stdout
    _names(verdict.stdout, FILES, key, case.rule)
    assert cli("list", str(run / "checkpoint")).returncode == 1
    cfg = CheckpointConfig(enable=True, interval=1, verify_on_load=False)
    mgr = CheckpointManager(cfg, run, _model(), states={"train_state": Counter()})
    with mgr, pytest.raises(CorruptCheckpoint) as e:
        mgr.load()
    _names(str(e.value), FILES, key, case.rule)


def test_lightning_checkpoint_io_refuses_a_crafted_folder_naming_it(tmp_path):
    """Lightning's ``DcpCheckpointIO.load_checkpoint`` on crafted folders: one error naming the
    file, the key and the rule (never DCP's ``CheckpointException`` with a traceback inside),
    with and without its verification on load."""
    pytest.importorskip("lightning")
    from dcpkit.integrations.lightning import DcpCheckpointIO

    model = _model()
    checkpoint = {"state_dict": model.state_dict(), "global_step": 1, "epoch": 0}
    DcpCheckpointIO().save_checkpoint(checkpoint, tmp_path / "good.ckpt")
    md = pickle.loads((tmp_path / "good.ckpt" / ".metadata").read_bytes())
    key = next(
        k
        for k, v in md.state_dict_metadata.items()
        if hasattr(v, "chunks") and len(v.size) == 2 and v.size[0] != v.size[1]
    )
    for case in CASES:
        path = tmp_path / f"{case.name}.ckpt"
        shutil.copytree(tmp_path / "good.ckpt", path)
        craft(path, case, key, index=False)
        for verify in (True, False):
            with pytest.raises(CorruptCheckpoint) as e:
                DcpCheckpointIO(verify_on_load=verify).load_checkpoint(path)
            text = str(e.value)
            assert "Traceback" not in text and key in text, (case.name, verify, text)
            assert any(f in text for f in FILES) or path.name in text, (case.name, text)


def test_accelerate_and_torchtitan_refuse_a_crafted_folder_naming_it(tmp_path):
    """Accelerate's ``AcceleratorCheckpoint.load_state`` and TorchTitan's checkpoint manager
    (dcpkit's, as TorchTitan builds it) refuse every crafted case the same way."""
    pytest.importorskip("accelerate")
    pytest.importorskip("torchtitan")
    from accelerate import Accelerator

    from dcpkit.integrations.accelerate import AcceleratorCheckpoint
    from dcpkit.integrations.torchtitan import DcpkitCheckpointManager

    accelerator = Accelerator(cpu=True)
    config = DcpkitCheckpointManager.Config(enable=True, interval=1)

    def titan(folder: Path) -> DcpkitCheckpointManager:
        return DcpkitCheckpointManager(
            config, dataloader=None, model_parts=[_model()], optimizers=Counter(),
            lr_schedulers=Counter(), states={}, base_folder=str(folder),
        )  # fmt: skip

    writer = titan(tmp_path / "titan")
    writer.save(1, last_step=False)
    writer.close()
    with AcceleratorCheckpoint(accelerator, tmp_path / "accelerate", _model()) as ckpt:
        ckpt.save_state(1, force=True)
    key = "tok_embeddings.weight"
    for case in CASES:
        for name in ("titan", "accelerate"):
            run = tmp_path / f"{name}-{case.name}"
            shutil.copytree(tmp_path / name, run)
            craft(run / "checkpoint" / "step-1", case, key)
            with pytest.raises(CorruptCheckpoint) as e:
                if name == "titan":
                    reader = titan(run)
                    try:
                        reader.load()
                    finally:
                        reader.close()
                else:
                    with AcceleratorCheckpoint(accelerator, run, _model()) as ckpt:
                        ckpt.load_state()
            _names(str(e.value), FILES, key, case.rule)
