"""A folder's names are claims to check: a step folder whose manifest records another step
(swapped, renamed or linked in under another name) is refused by every entry point, naming both
steps; a name that only looks like a step's (a leading zero, another script's digits, a trailing
newline) is never read as a step and ``list`` names it as foreign."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch

from conftest import Counter, bounded, cli
from crafted import hostile_markers
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager, CorruptCheckpoint
from dcpkit.layout import parse_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _manager(run: Path, counter: Counter | None = None, **options) -> CheckpointManager:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    cfg = CheckpointConfig(enable=True, interval=1, **{"keep_latest_k": 0, **options})
    model = torch.nn.Linear(8, 8)
    return CheckpointManager(cfg, run, model, states={"train_state": counter or Counter()})


@pytest.fixture(scope="module")
def steps(tmp_path_factory) -> Path:
    """A run with steps 10 and 20 (its train state's step saved with each)."""
    run = tmp_path_factory.mktemp("claims") / "run"
    counter = Counter()
    with _manager(run, counter) as mgr:
        for step in (10, 20):
            counter.step = step
            mgr.save(step)
    return run


def _copy(steps: Path, tmp_path: Path) -> tuple[Path, Path]:
    run = copy_run(steps, tmp_path / "run")
    return run, run / "checkpoint"


def copy_run(run: Path, to: Path) -> Path:
    """A copy of a run, links as links and FIFOs as FIFOs (never opened)."""
    shutil.copytree(run, to, symlinks=True, copy_function=_copy_entry)
    return to


def _copy_entry(src: str, dst: str) -> None:
    info = os.lstat(src)
    if stat.S_ISFIFO(info.st_mode):
        os.mkfifo(dst)
    elif info.st_blocks * 512 < info.st_size:  # sparse: as sparse, not a GiB of zeros
        with open(dst, "wb") as f:
            f.truncate(info.st_size)
    else:
        shutil.copy2(src, dst)


def _refused_everywhere(run: Path, folder: Path, name: str, recorded: int, named: int) -> None:
    rule = f"records step {recorded}, but its folder is named step-{named}"
    verdict = cli("verify", str(folder / name))
    assert verdict.returncode == 1 and rule in verdict.stdout, verdict.stdout
    assert "OK" not in verdict.stdout.replace("NOT OK", ""), verdict.stdout
    listed = cli("list", str(folder))
    assert listed.returncode == 1, listed.stdout
    line = next(x for x in listed.stdout.splitlines() if x.startswith(name + " "))
    assert "CORRUPT" in line and rule in line and "verified" not in line, listed.stdout
    for verify in (True, False):
        counter = Counter()
        mgr = _manager(run, counter, verify_on_load=verify)
        with mgr, pytest.raises(CorruptCheckpoint) as e:
            mgr.load()
        assert rule in str(e.value) and "dcpkit.json" in str(e.value), e.value
        assert counter.step == 0  # nothing restored


def test_swapped_step_folders_are_refused_by_verify_list_and_load(steps, tmp_path):
    run, folder = _copy(steps, tmp_path)
    (folder / "step-10").rename(folder / "x")
    (folder / "step-20").rename(folder / "step-10")
    (folder / "x").rename(folder / "step-20")
    _refused_everywhere(run, folder, "step-20", 10, 20)


def test_a_linked_step_or_a_data_file_linked_out_is_refused(steps, tmp_path):
    """``step-30 -> elsewhere/step-20``, and a data file of step-20 linked to a copy outside the
    folder: verify, list and the load refuse each, naming the link."""
    run, folder = _copy(steps, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(folder / "step-20", elsewhere)
    os.symlink(elsewhere, folder / "step-30")
    verdict = cli("verify", str(folder / "step-30"))
    assert verdict.returncode == 1 and f"step-30 is a link to {elsewhere}" in verdict.stdout
    assert "records step 20, but its folder is named step-30" in verdict.stdout, verdict.stdout
    listed = cli("list", str(folder))
    line = next(x for x in listed.stdout.splitlines() if x.startswith("step-30 "))
    assert listed.returncode == 1 and "CORRUPT" in line and "is a link to" in line, line
    mgr = _manager(run)
    with mgr, pytest.raises(CorruptCheckpoint, match="step-30 is a link to"):
        mgr.load()
    (folder / "step-30").unlink()
    data = next((folder / "step-20").glob("*.distcp"))
    data.unlink()
    os.symlink(elsewhere / data.name, data)
    rule = f"{data.name} is a link to {elsewhere / data.name}, outside the checkpoint folder"
    verdict = cli("verify", str(folder / "step-20"))
    assert verdict.returncode == 1 and rule in verdict.stdout, verdict.stdout
    for verify in (True, False):
        mgr = _manager(run, verify_on_load=verify)
        with mgr, pytest.raises(CorruptCheckpoint, match="outside the checkpoint folder"):
            mgr.load()


def test_the_step_names_are_ascii_digits_without_a_leading_zero():
    assert [parse_step(n) for n in ("step-0", "step-7", "step-30", "step-1200")] == [0, 7, 30, 1200]
    looks_like = ("step-00030", "step-030", "step-٣٠", "step-３０", "step-30\n", "step-+30")
    for name in (*looks_like, "step-", "step-30.5"):
        assert parse_step(name) is None, name


@pytest.mark.parametrize("stray", ["step-00030", "step-٣٠", "step-30\n"])
def test_a_name_that_looks_like_a_step_is_foreign_never_a_step(steps, tmp_path, stray):
    """A copy of step-20 under a name no step may have: the load takes step 20, `list` names
    the stray as foreign and reads no step from it, nothing is deleted."""
    run, folder = _copy(steps, tmp_path)
    shutil.copytree(folder / "step-20", folder / stray)
    listed = cli("list", str(folder))
    assert listed.returncode == 0, listed.stdout
    assert "deleted" not in listed.stdout and "step-30 " not in listed.stdout, listed.stdout
    assert "foreign: not a step's name" in listed.stdout, listed.stdout
    assert "step-20" in listed.stdout and "verified" in listed.stdout
    counter = Counter()
    with _manager(run, counter) as mgr:
        assert mgr.load() == 20
    assert counter.step == 20
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(
        ["step-10", "step-20", stray]
    )


def _kept(folder: Path, step: int, record: dict | None) -> Path:
    marker = folder / ".dcpkit-holds" / f"kept-step-{step}.json"
    marker.parent.mkdir(exist_ok=True)
    marker.write_text("{}" if record is None else json.dumps(record))
    return marker


def test_a_kept_marker_is_a_claim_and_deletes_nothing_it_does_not_prove(steps, tmp_path, caplog):
    """``kept-step-N.json`` (retention kept a step for a reader, the last reader deletes it)
    written by someone else or left stale: a 3-byte one on the newest step, retention's shape on
    the newest step, retention's shape read by read-only commands. No entry point deletes a
    step; the reader that ignores a marker says why."""
    run, folder = _copy(steps, tmp_path)
    _kept(folder, 20, None)
    _kept(folder, 10, {"by": "retention", "step": 10, "since": 0})  # only a loader may act on it
    for args in (
        ["list", str(folder)],
        ["inspect", str(folder / "step-20")],
        ["verify", str(folder), "--step", "latest"],
        ["verify", str(folder / "step-10")],
        ["diff", str(folder / "step-10"), str(folder / "step-20")],
    ):
        done = cli(*args)
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, (args, done)
        assert "deleted" not in done.stdout + done.stderr, (args, done.stdout)
        assert sorted(p.name for p in folder.glob("step-*")) == ["step-10", "step-20"], args
    counter = Counter()
    with caplog.at_level(logging.WARNING, logger="dcpkit"), _manager(run, counter) as mgr:
        assert mgr.load() == 20  # a reader of step 20 letting go: the marker is no decision
    assert counter.step == 20
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-10", "step-20"]
    assert "kept-step-20.json is no decision of retention" in caplog.text, caplog.text
    assert "it does not name step 20 as kept by retention" in caplog.text
    _kept(folder, 20, {"by": "retention", "step": 20, "since": 0})
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dcpkit"), _manager(run) as mgr:
        assert mgr.load() == 20
    assert (folder / "step-20").is_dir()
    assert "step-20 is the newest published step, which retention never deletes" in caplog.text


def test_a_step_whose_manifest_was_removed_is_refused_in_a_run_that_writes_them(steps, tmp_path):
    """step-20's ``dcpkit.json`` deleted and a byte of its data flipped: with step-10's
    manifest beside it, verify, list and the load refuse step-20 (no checksums were turned
    off); step-10 alone, without its manifest (a step from before the run took dcpkit on, or
    checkpoints from others), still loads."""
    run, folder = _copy(steps, tmp_path)
    (folder / "step-20" / "dcpkit.json").unlink()
    data = max((folder / "step-20").glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    rule = "is missing, while step-10 before it in the same folder has one"
    verdict = cli("verify", str(folder / "step-20"))
    assert verdict.returncode == 1 and rule in verdict.stdout, verdict.stdout
    listed = cli("list", str(folder))
    line = next(x for x in listed.stdout.splitlines() if x.startswith("step-20 "))
    assert listed.returncode == 1 and "CORRUPT" in line and rule in line, listed.stdout
    for verify in (True, False):
        mgr = _manager(run, verify_on_load=verify)
        with mgr, pytest.raises(CorruptCheckpoint, match=rule):
            mgr.load()
    shutil.rmtree(folder / "step-20")
    (folder / "step-10" / "dcpkit.json").unlink()
    counter = Counter()
    with _manager(run, counter) as mgr:
        assert mgr.load() == 10
    assert counter.step == 10


def test_fifos_devices_and_huge_markers_neither_hang_nor_exhaust(steps, tmp_path, caplog):
    """Every marker kind as a FIFO, a link to /dev/zero and a 1 GiB sparse file, a manifest
    linked to /dev/zero, a FIFO lease: list, verify, inspect and the load finish (each within
    a minute), read no marker as a record, and refuse the manifest naming it."""
    run, folder = _copy(steps, tmp_path)
    holds = folder / ".dcpkit-holds"
    hostile_markers(folder, 20)
    for args in (
        ["list", str(folder)],
        ["verify", str(folder), "--step", "latest"],
        ["inspect", str(folder / "step-20")],
        ["diff", str(folder / "step-10"), str(folder / "step-20")],
        ["to-torch", str(folder / "step-20"), str(tmp_path / "out.pth")],
    ):
        done = bounded(lambda args=args: cli(*args))
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done)
    assert (tmp_path / "out.pth").is_file()
    counter = Counter()
    with _manager(run, counter) as mgr:
        assert bounded(mgr.load) == 20  # the FIFO deleting-step-20.json is no deletion
    assert counter.step == 20
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-10", "step-20"]
    retained = copy_run(run, tmp_path / "retained")  # retention at the next saves: its own rule
    with _manager(retained, keep_latest_k=2) as mgr:
        bounded(lambda: (mgr.load(), mgr.save(30), mgr.save(40), mgr.wait()))
        assert mgr.published_steps() == [30, 40]
    left = {p.name for p in (retained / "checkpoint" / ".dcpkit-holds").iterdir()}
    gone = {"deleting-step-20.json", "kept-step-20.json"}  # named steps retention deleted
    assert left == {p.name for p in holds.iterdir()} - gone  # unlinked, never opened
    manifest = folder / "step-20" / "dcpkit.json"
    manifest.unlink()
    os.symlink("/dev/zero", manifest)
    verdict = bounded(lambda: cli("verify", str(folder / "step-20")))
    assert verdict.returncode == 1 and "is a device, not a regular file" in verdict.stdout
    assert "dcpkit.json" in verdict.stdout, verdict.stdout
    mgr = _manager(run)
    with mgr, pytest.raises(CorruptCheckpoint, match="is a device, not a regular file"):
        bounded(mgr.load)
    lease = folder / ".dcpkit-lease"
    os.mkfifo(lease)
    with pytest.raises(CheckpointError) as e:
        bounded(lambda: _manager(run, storage_retry_s=5).save(21))
    assert "is a FIFO, not a regular file" in str(e.value) and ".dcpkit-lease" in str(e.value)


def test_a_heartbeat_from_the_future_keeps_nothing_alive(tmp_path, caplog):
    """A hold and a lease dated a year ahead (a wrong clock, or forged): retention deletes the
    step as if no reader held it, and a new run takes the lease over, saying so."""
    from dcpkit.storage.markers import MAX_SKEW_S

    folder = tmp_path / "run" / "checkpoint"
    ahead = time.time() + 365 * 86400
    with _manager(tmp_path / "run", keep_latest_k=2) as mgr:
        mgr.save(1)
        holds = folder / ".dcpkit-holds"
        holds.mkdir()
        hold = {"id": "x", "purpose": "a reader", "step": 1, "heartbeat": ahead, "expires_s": 60}
        (holds / "hold-x.json").write_text(json.dumps(hold))
        near = dict(hold, step=2, heartbeat=time.time() + MAX_SKEW_S / 2)  # within the skew
        (holds / "hold-y.json").write_text(json.dumps(near))
        for step in (2, 3, 4):
            mgr.save(step)
        mgr.wait()
        assert mgr.published_steps() == [2, 3, 4]  # 1 deleted, 2 held (keep_latest_k 2)
    lease = {"run_id": "ahead", "host": "elsewhere", "pid": 1, "started": 0, "heartbeat": ahead}
    (folder / ".dcpkit-lease").write_text(json.dumps(lease))
    with caplog.at_level(logging.WARNING, logger="dcpkit"), _manager(tmp_path / "run") as mgr:
        mgr.load()
        mgr.save(5)
    assert "taking over the lease" in caplog.text and "run ahead" in caplog.text
