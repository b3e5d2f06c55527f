"""Nothing silently lost: per-rank state, strict loads of every state a run checkpoints."""

from __future__ import annotations

import contextlib
import errno
import json
import subprocess

import pytest
import torch

from conftest import Counter, cli, run_script
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager
from dcpkit.engine.async_save import AsyncSaveError
from dcpkit.storage import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _positions(proc) -> list[int]:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("POSITIONS "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.dist
def test_per_rank_state_resumes_per_rank_and_reshards_by_rule(tmp_path):
    folder = str(tmp_path / "checkpoint")
    run_script(4, "per_rank_states.py", folder, "save")
    saved = [100 * r + 7 for r in range(4)]
    assert _positions(run_script(4, "per_rank_states.py", folder, "load")) == saved
    # At 2 ranks, rank r takes saved rank r % 4 (the documented rule, logged).
    assert _positions(run_script(2, "per_rank_states.py", folder, "load")) == saved[:2]
    # A state with its own hook reshards itself: rank r merges saved ranks r, r + 2.
    merged = [saved[0] + saved[2], saved[1] + saved[3]]
    assert _positions(run_script(2, "per_rank_states.py", folder, "reshard")) == merged


@pytest.mark.dist
def test_a_state_that_differs_between_ranks_must_be_declared(tmp_path):
    proc = run_script(2, "per_rank_states.py", str(tmp_path / "checkpoint"), "undeclared")
    assert "REFUSED rank 0: states['sampler'] differs between ranks (rank 0 and rank 1)" in (
        proc.stdout
    )
    assert "per_rank_states={'sampler': ...}" in proc.stdout
    assert not (tmp_path / "checkpoint" / "step-1").exists()


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def test_a_group_the_checkpoint_lacks_is_an_error(tmp_path):
    cfg = CheckpointConfig(enable=True, interval=1)
    with CheckpointManager(cfg, tmp_path, _model(), states={"data": Counter()}) as mgr:
        mgr.save(1)
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(cfg, tmp_path, model, opt, dataloader=Counter())
    with pytest.raises(CheckpointError, match=r"holds no 'optimizer', 'dataloader'"):
        mgr.load()
    # Named in exclude_from_loading, they start fresh on purpose.
    cfg = CheckpointConfig(enable=True, exclude_from_loading=["optimizer", "dataloader"])
    assert CheckpointManager(cfg, tmp_path, model, opt, dataloader=Counter()).load() == 1


def test_a_model_only_save_loads_only_when_asked(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    cfg = CheckpointConfig(enable=True, interval=10)
    with CheckpointManager(cfg, tmp_path, model, opt, states={"data": Counter()}) as mgr:
        mgr.save(3, last_step=True)  # a finished run's last save: the model only
    fresh = torch.nn.Linear(4, 4)
    opt2 = torch.optim.AdamW(fresh.parameters())
    with pytest.raises(CheckpointError, match=r"is a model-only save.*load_model_only = true"):
        CheckpointManager(cfg, tmp_path, fresh, opt2, states={"data": Counter()}).load()
    cfg = CheckpointConfig(enable=True, load_model_only=True)
    assert CheckpointManager(cfg, tmp_path, fresh, opt2, states={"data": Counter()}).load() == 3
    assert torch.equal(fresh.weight, model.weight)


@contextlib.contextmanager
def _small_disk(path, size: int):
    """A tmpfs of ``size`` bytes at ``path`` (root can mount one; the test needs it)."""
    path.mkdir(parents=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_full_disk_is_named_and_leaves_the_previous_step(mode, tmp_path, process_group):
    from dcpkit.models import build_model

    def manager(folder):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = build_model("llama3", "debugmodel", max_seq_len=16, n_layers=1)
        cfg = CheckpointConfig(
            enable=True, folder=str(folder), interval=1, keep_latest_k=0, async_mode=mode
        )
        return CheckpointManager(cfg, tmp_path, model)

    probe = manager(tmp_path / "probe")
    probe.save(1)
    probe.close()
    one_step = open_store(tmp_path / "probe").tree_size("step-1")
    with _small_disk(tmp_path / "disk", one_step * 3 // 2) as disk:
        mgr = manager(disk)
        mgr.save(1)
        mgr.wait()
        with pytest.raises((CheckpointError, AsyncSaveError)) as failure:
            mgr.save(2)
            mgr.wait()
        text = str(failure.value)
        assert "saving step 2 into" in text and "the disk is full" in text, text
        assert "Step 1 is still the latest" in text
        store = open_store(disk)
        assert store.published_steps() == [1]
        assert [n for n in store.list_names() if n.startswith(".tmp")] == []
        with contextlib.suppress(Exception):
            mgr.close()


def test_a_full_disk_in_a_conversion_is_named(tmp_path):
    """A conversion writing DCP onto a full disk says so (torch's own words are "unexpected
    pos"), and leaves no output behind."""
    from dcpkit.convert.torch_save import from_torch

    pth = tmp_path / "state.pth"
    torch.save({f"w{i}": torch.randn(256, 1024) for i in range(4)}, pth)  # 4 MiB
    with _small_disk(tmp_path / "disk", 2 << 20) as disk:
        with pytest.raises(OSError) as failure:
            from_torch(pth, disk / "ckpt", budget=256 << 10)
        assert failure.value.errno == errno.ENOSPC, failure.value
        assert "the disk is full" in str(failure.value) and str(disk) in str(failure.value)
        assert sorted(p.name for p in disk.iterdir()) == []


class Generator:
    """A user state holding a tensor (a private generator's state)."""

    def state_dict(self):
        return {"gen_state": torch.arange(8, dtype=torch.uint8)}

    def load_state_dict(self, state):
        pass


def test_user_states_are_not_counted_as_the_model(tmp_path):
    model = _model()
    cfg = CheckpointConfig(enable=True, interval=1)
    with CheckpointManager(cfg, tmp_path, model, states={"data": Generator()}) as mgr:
        mgr.save(1)
    ckpt = tmp_path / "checkpoint" / "step-1"
    proc = cli("inspect", str(ckpt), "--json")
    groups = json.loads(proc.stdout)["groups"]
    assert groups["model"]["tensors"] == len(model.state_dict()) == 2
    assert groups["data"] == {"tensors": 1, "bytes": 8}
    out = tmp_path / "model.pth"
    proc = cli("to-torch", str(ckpt), str(out), "--model-only")
    assert proc.returncode == 0, proc.stderr
    fresh = torch.nn.Linear(4, 4)
    fresh.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert torch.equal(fresh.weight, model.weight)


@pytest.mark.dist
def test_a_load_failing_on_one_rank_fails_on_every_rank(tmp_path):
    """Each rank plans and reads its own part of a load; one rank's failure still stops all,
    with that rank's reason, and no rank is left waiting."""
    proc = run_script(2, "load_failures.py", str(tmp_path / "corrupt"), "corrupt")
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "LOAD")))
    assert len(lines) == 2 and all(line.startswith("FAILED") for line in lines), proc.stdout
    assert all("failed verification: __1_0.distcp: checksum mismatch" in line for line in lines)
    # Without checksums, a load still checks sizes and structure on every rank before reading
    # (the checks verify runs): rank 1's cut file fails both ranks together, one message.
    proc = run_script(2, "load_failures.py", str(tmp_path / "cut"), "truncated")
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "LOAD")))
    assert len(lines) == 2 and all(line.startswith("FAILED") for line in lines), proc.stdout
    assert all("__1_0.distcp" in line and "truncated" in line for line in lines), lines
    assert lines[0].split(": ", 1)[1] == lines[1].split(": ", 1)[1], lines
    # Intact files, but rank 1's own state refuses what it reads back (after every read):
    # both ranks fail together with its reason and the rank, neither left waiting.
    proc = run_script(2, "load_failures.py", str(tmp_path / "refused"), "refused")
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "LOAD")))
    assert len(lines) == 2 and all(line.startswith("FAILED") for line in lines), proc.stdout
    assert all("position 1 is past this rank's shard (rank 1)" in line for line in lines), lines
    assert lines[0].split(": ", 1)[1] == lines[1].split(": ", 1)[1], lines
