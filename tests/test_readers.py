"""Readers beside a running job: what a reader reads is held against the run's retention
(deleted at a later save once released, or once a killed reader's hold expires), `latest` is
chosen and held in one operation, and a follower exports each step the run publishes."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    BUCKET,
    CONFIG,
    ROOT,
    Beside,
    cli,
    read_metrics,
    run_train,
    torchrun_env,
    use_endpoint,
)
from dcpkit import CheckpointConfig, CheckpointManager
from dcpkit.launch import torchrun_command
from dcpkit.readers import open_reading
from dcpkit.storage import open_store
from dcpkit.storage.holds import HOLDS, StepGone, delete_unless_held, hold_step

DEBUG_MODEL = ("--model", "llama3", "--flavor", "debugmodel")


def _manager(folder: str, keep: int = 2, **options) -> CheckpointManager:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    config = CheckpointConfig(enable=True, folder=folder, interval=1, keep_latest_k=keep, **options)
    return CheckpointManager(config, "/", model, torch.optim.SGD(model.parameters(), lr=0.1))


def _on_seaweedfs(request) -> None:
    """This test's S3 clients at SeaweedFS; none of them left cached for the tests after it."""
    import s3fs

    use_endpoint(request.getfixturevalue("monkeypatch"), request.getfixturevalue("seaweedfs"))
    request.addfinalizer(s3fs.S3FileSystem.clear_instance_cache)


def _folder(kind: str, tmp_path: Path, request, name: str) -> str:
    if kind == "local":
        return str(tmp_path / name)
    _on_seaweedfs(request)
    return f"s3://{BUCKET}/readers-{tmp_path.name}/{name}"


@pytest.mark.parametrize("kind", ["local", "seaweedfs"])
def test_retention_keeps_a_held_step_and_deletes_it_at_a_save_once_released(
    kind, tmp_path, request, caplog
):
    folder = _folder(kind, tmp_path, request, "checkpoint")
    with caplog.at_level(logging.INFO, logger="dcpkit"), _manager(folder) as mgr:
        mgr.save(1)
        held = open_reading(folder, "latest", purpose="an evaluation")
        assert held.name == "step-1"
        for step in (2, 3, 4):
            mgr.save(step)
            mgr.wait()
        assert mgr.published_steps() == [1, 3, 4]  # 2 went; 1 is held
        assert (
            "retention keeps step 1 while 1 reader(s) hold it: an evaluation (host" in caplog.text
        )
        listing = cli("list", folder)
        assert listing.returncode == 0, listing.stderr
        row = next(line for line in listing.stdout.splitlines() if line.startswith("step-1 "))
        assert "held by 1 reader(s): an evaluation" in row
        assert "1 step(s) held by readers" in listing.stdout
        held.release()  # the last reader to hold it: deletes it as retention wanted
        assert mgr.published_steps() == [3, 4]
        assert "deleted " in caplog.text and "step-1, which the run's retention kept" in caplog.text
        mgr.save(5)
        mgr.wait()
        assert mgr.published_steps() == [4, 5]
    assert "held by" not in cli("list", folder).stdout
    assert open_store(folder).list_names(HOLDS) == []  # released holds leave nothing behind


HOLDING = """import sys, time
import dcpkit
with dcpkit.reading(sys.argv[1], step="latest", purpose="an evaluation") as held:
    print("held", held.name, flush=True)
    time.sleep(600)
"""


def test_a_killed_readers_step_is_listed_as_kept_and_pruned_once_its_hold_expired(tmp_path):
    """A reader SIGKILLed at the run's last save never lets go: its step outlives retention
    (keep_latest_k 2 leaves 3 steps). `list` names it "kept past retention" with its reader and
    deletes nothing, run 100 times beside the run's last saves; `prune` leaves it while the
    hold lives; once the hold has expired (4 s here), `list` says so and `prune` deletes it and
    the dead hold: 2 steps left."""
    folder = tmp_path / "checkpoint"
    store = open_store(folder)
    env = torchrun_env({"DCPKIT_HOLD_EXPIRY_S": "4"})
    with _manager(str(folder)) as mgr:
        mgr.save(1)
        mgr.save(2)
        mgr.wait()
        reader = subprocess.Popen([sys.executable, "-c", HOLDING, str(folder)], env=env,
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert reader.stdout.readline().split() == ["held", "step-2"]
            for step in (3, 4):  # the run's last saves, `list` beside them again and again
                mgr.save(step)
                for _ in range(50):  # (retention runs in the background meanwhile)
                    listing = cli("list", str(folder))
                    assert listing.returncode == 0, listing.stderr
            mgr.wait()
            listing = cli("list", str(folder))
            row = next(x for x in listing.stdout.splitlines() if x.startswith("step-2 "))
            assert "held by 1 reader(s): an evaluation (host" in row, row
            assert "kept past retention for them" in row, row
            pruned = cli("prune", str(folder))
            assert pruned.returncode == 0 and "kept step-2: held by 1 reader(s)" in pruned.stdout
        finally:
            reader.kill()
            reader.wait()
    assert store.published_steps() == [2, 3, 4]
    deadline = time.monotonic() + 60  # the hold's expiry passes (bounded: a hang fails)
    while "hold expired" not in (row := cli("list", str(folder)).stdout):
        assert time.monotonic() < deadline, row
        time.sleep(0.2)
    line = next(x for x in row.splitlines() if x.startswith("step-2 "))
    assert "its reader's hold expired at" in line and f"`dcpkit prune {folder}`" in line, line
    assert store.published_steps() == [2, 3, 4]  # listing deleted nothing
    pruned = cli("prune", str(tmp_path))  # a run's folder: its checkpoint folder
    assert pruned.returncode == 0, pruned.stderr
    assert f"deleted {folder}/step-2, kept by retention for a reader now gone" in pruned.stdout
    assert re.search(r"removed .*/hold-[0-9a-f]+\.json", pruned.stdout), pruned.stdout
    assert store.published_steps() == [3, 4]
    assert store.list_names(HOLDS) == []
    assert cli("prune", str(folder)).stdout.strip() == f"{folder}: nothing to prune"


def _take(store, start: threading.Barrier, result: dict) -> None:
    start.wait()
    try:
        result["hold"] = hold_step(store, 1, "race")
    except StepGone:
        result["hold"] = None
    except Exception as e:  # the round's assertion names it
        result["hold"], result["error"] = None, e


def _drop(store, start: threading.Barrier, result: dict) -> None:
    start.wait()
    result["kept_by"] = delete_unless_held(store, 1, store.delete)


def test_a_reader_and_retention_never_both_go_ahead(tmp_path):
    """Retention deleting a step while a reader takes it: in every round either the reader holds
    it and it stays, or the reader is told it is gone; never a hold on a step being deleted."""
    folder = tmp_path / "checkpoint"
    with _manager(str(folder), keep=0) as mgr:
        mgr.save(1)
        mgr.save(2)  # retention deletes older steps than the newest
    store = open_store(folder)
    template = tmp_path / "template"
    shutil.copytree(folder / "step-1", template)
    outcomes = {"held": 0, "refused": 0, "kept": 0, "deleted": 0}
    for _ in range(150):
        if not (folder / "step-1").exists():
            shutil.copytree(template, folder / "step-1")
        start = threading.Barrier(2)
        result: dict[str, object] = {}
        threads = [
            threading.Thread(target=_take, args=(store, start, result)),
            threading.Thread(target=_drop, args=(store, start, result)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert "error" not in result, f"the reader failed: {result['error']!r}"
        hold = result["hold"]
        if hold is not None:
            assert result["kept_by"], "retention deleted a step a reader held"
            assert store.is_published("step-1")
            hold.release()
        outcomes["held" if hold is not None else "refused"] += 1
        outcomes["kept" if result["kept_by"] else "deleted"] += 1
    assert outcomes["held"] and outcomes["deleted"], outcomes  # both sides won sometimes
    assert store.list_names(HOLDS) == []


def test_markers_written_while_others_empty_and_remove_their_folder_never_fail(tmp_path):
    """Readers and deleters each remove the holds folder once they empty it: a marker written
    as the folder goes (inside the write, or inside its mkdir) makes the folder again."""
    store = open_store(tmp_path / "checkpoint")
    errors: list[BaseException] = []

    def churn(n: int) -> None:
        for _ in range(2000):
            try:
                store.write_bytes(f"{HOLDS}/hold-{n}.json", b"{}", durable=False)
                store.remove(f"{HOLDS}/hold-{n}.json")
                store.remove_empty_folder(HOLDS)
            except Exception as e:  # the test counts every failure
                errors.append(e)

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [], f"{len(errors)} marker writes failed, the first: {errors[0]!r}"
    assert store.list_names(HOLDS) == []


def test_a_second_reader_of_a_held_step_is_never_turned_away(tmp_path):
    """Retention trying a held step (and keeping it) while another reader takes the same step:
    the reader waits for retention's decision instead of taking its marker for a deletion."""
    folder = tmp_path / "checkpoint"
    with _manager(str(folder), keep=0) as mgr:
        mgr.save(1)
        mgr.save(2)  # retention deletes older steps than the newest
    store = open_store(folder)
    first = hold_step(store, 1, "first reader")
    stop, kept = threading.Event(), []

    def retention() -> None:
        while not stop.is_set():
            kept.append(bool(delete_unless_held(store, 1, store.delete)))

    deleter = threading.Thread(target=retention)
    deleter.start()
    try:
        for _ in range(100):
            hold_step(store, 1, "second reader").release()  # StepGone would fail the test
    finally:
        stop.set()
        deleter.join()
    assert len(kept) > 10 and all(kept) and store.is_published("step-1")
    first.release()  # the last reader: deletes what retention kept for it
    assert not store.is_published("step-1") and store.list_names(HOLDS) == []


@pytest.mark.alone
def test_a_killed_reader_stops_holding_after_its_stated_expiry(tmp_path, caplog):
    folder = tmp_path / "checkpoint"
    reader = (
        "import sys, time, dcpkit\n"
        "reading = dcpkit.reading(sys.argv[1], step='latest', purpose='doomed reader')\n"
        "held = reading.__enter__()\n"
        "print(held.name, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "DCPKIT_HOLD_EXPIRY_S": "4"}
    with caplog.at_level(logging.INFO, logger="dcpkit"), _manager(str(folder)) as mgr:
        mgr.save(1)
        proc = subprocess.Popen(
            [sys.executable, "-c", reader, str(folder)], env=env, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "step-1"
        record = json.loads(next((folder / HOLDS).glob("hold-*.json")).read_text())
        assert record["expires_s"] == 4 and record["purpose"] == "doomed reader"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.time()
        mgr.save(2)
        mgr.save(3)
        mgr.wait()
        assert 1 in mgr.published_steps(), "deleted before the hold expired"
        time.sleep(max(0.0, killed + 4.5 - time.time()))
        mgr.save(4)  # the first save after the expiry
        mgr.wait()
        assert mgr.published_steps() == [3, 4]
    assert "retention removed step 1, 2 (1 kept until readers released it)" in caplog.text


def test_a_reader_stopped_past_its_hold_expiry_is_told_its_hold_lapsed(tmp_path):
    """A reader SIGSTOPped longer than its hold's expiry: retention deletes its step meanwhile
    (the hold is no longer renewed), and the read that follows fails naming the lapsed hold,
    not the missing file alone."""
    folder = tmp_path / "checkpoint"
    reader = (
        "import sys, dcpkit\n"
        "with dcpkit.reading(sys.argv[1], step='latest', purpose='paused reader') as held:\n"
        "    print(held.name, flush=True)\n"
        "    sys.stdin.readline()  # stopped here\n"
        "    with held.store.view(held.name) as view:\n"
        "        (view.path / '.metadata').read_bytes()\n"
    )
    env = {**os.environ, "DCPKIT_HOLD_EXPIRY_S": "1"}
    with _manager(str(folder)) as mgr:
        mgr.save(1)
        proc = subprocess.Popen(
            [sys.executable, "-c", reader, str(folder)], env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout.readline().strip() == "step-1"
        proc.send_signal(signal.SIGSTOP)
        step, deadline = 1, time.monotonic() + 60
        while 1 in mgr.published_steps():  # kept while held, deleted once the hold expired
            assert time.monotonic() < deadline, mgr.published_steps()
            step += 1
            mgr.save(step)
            mgr.wait()
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode != 0
    assert "the hold on" in err and "step-1 expired at" in err, err[-2000:]
    assert "was this process stopped?" in err and "deleted the step" in err, err[-2000:]


def test_latest_is_the_newest_published_step_or_the_one_before_a_corrupt_one(tmp_path):
    folder = tmp_path / "checkpoint"
    with _manager(str(folder), keep=0) as mgr:
        for step in (1, 2, 3):
            mgr.save(step)
    verified = cli("verify", str(folder / "latest"))
    assert verified.returncode == 0 and f"OK: {folder / 'step-3'}" in verified.stdout
    assert f"OK: {folder / 'step-2'}" in cli("verify", str(folder), "--step", "2").stdout
    missing = cli("verify", str(folder), "--step", "7")
    assert missing.returncode == 2 and "published steps: 1, 2, 3" in missing.stderr
    inspected = json.loads(cli("inspect", str(folder), "--step", "latest", "--json").stdout)
    assert inspected["step"] == 3
    (folder / "step-3" / "__0_0.distcp").write_bytes(b"torn")  # the newest is corrupt
    verified = cli("verify", str(folder), "--step", "latest")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert f"OK: {folder / 'step-2'}" in verified.stdout
    assert f"note: {folder / 'step-3'} is corrupt (__0_0.distcp: has 4 bytes" in verified.stdout
    out = tmp_path / "model.pth"
    converted = cli("to-torch", str(folder / "latest"), str(out), "--model-only")
    assert converted.returncode == 0, converted.stderr
    with _manager(str(tmp_path / "elsewhere"), keep=0) as mgr:
        assert "model" in mgr.load_from(folder, step="latest")
        expected = torch.load(out, weights_only=True)
        for key, value in mgr.model.parts[0].state_dict().items():
            assert torch.equal(value, expected[key])
    assert not (folder / HOLDS).exists()  # released holds leave nothing behind


def _start_train(dump: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    cmd = torchrun_command(
        2, ["--job.config_file", str(CONFIG), "--job.dump_folder", str(dump), *overrides]
    )
    return subprocess.Popen(
        cmd, env=torchrun_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _low_priority() -> None:
    """An evaluation job sharing training's 2 cores: a tenth of a core while both are busy."""
    os.nice(10)


def _wait_for_line(path: Path, text: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    """Until ``proc`` has written ``text`` to ``path`` (a follower says once that it waits)."""
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert proc.poll() is None, f"it ended ({proc.returncode}):\n{path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout}s in {path}"
        time.sleep(0.2)


def _finish(
    proc: subprocess.Popen, what: str, timeout: float = 600, err: Path | None = None
) -> str:
    out, printed = proc.communicate(timeout=timeout)
    text = out + (printed or "") + (err.read_text() if err else "")
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{text[-5000:]}"
    return text


def test_follow_exports_every_step_of_a_run_in_order_none_twice(tmp_path, caplog):
    dump, out = tmp_path / "run", tmp_path / "exports"
    follower = subprocess.Popen(  # started before the run: it waits for the run to begin
        [sys.executable, "-m", "dcpkit.cli", "to-hf", str(dump), str(out), "--follow",
         *DEBUG_MODEL, "--poll", "0.2"],
        env=torchrun_env(), stdout=subprocess.PIPE, stderr=(tmp_path / "follower.err").open("w"),
        text=True, preexec_fn=_low_priority,
    )  # fmt: skip
    evaluation = subprocess.Popen(  # a second follower: the example, dcpkit.follow
        [sys.executable, str(ROOT / "examples" / "evaluation_job.py"), str(dump),
         str(tmp_path / "evaluated")],
        env=torchrun_env(), stdout=subprocess.PIPE, stderr=(tmp_path / "evaluation.err").open("w"),
        text=True, preexec_fn=_low_priority,
    )  # fmt: skip
    for name, proc in (("follower", follower), ("evaluation", evaluation)):
        _wait_for_line(tmp_path / f"{name}.err", "waiting for a run to save into", proc)
    with Beside(
        run_train, 2, dump, "--training.steps", "10", "--checkpoint.interval", "1",
        "--checkpoint.keep_latest_k", "2", "--checkpoint.last_save_model_only", "false",
    ) as train:  # fmt: skip
        train.result()
    printed = _finish(follower, "to-hf --follow", 300, tmp_path / "follower.err")
    evaluated = _finish(evaluation, "the evaluation example", 300, tmp_path / "evaluation.err")
    reads = [json.loads(x) for x in evaluated.splitlines() if x.startswith("{")]
    assert [r["step"] for r in reads] == list(range(1, 11)) and all(r["verified"] for r in reads)
    exported = re.findall(r"^to-hf: .* -> (\S+) in ", printed, re.MULTILINE)
    assert [Path(p).name for p in exported] == [f"step-{s}" for s in range(1, 11)], printed
    assert "10 step(s) exported" in printed
    assert sorted(p.name for p in out.iterdir()) == sorted(f"step-{s}" for s in range(1, 11))
    assert sorted(p.name for p in (dump / "checkpoint").glob("step-*")) == ["step-10", "step-9"]
    assert not (dump / "checkpoint" / HOLDS).exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = AutoModelForCausalLM.from_pretrained(out / "step-1")
    last = AutoModelForCausalLM.from_pretrained(out / "step-10")
    assert not torch.equal(first.lm_head.weight, last.lm_head.weight)
    text = "def main():\n    return 0\n"  # the run's own tokenizer, shipped with each export
    for folder in (out / "step-10", tmp_path / "evaluated" / "step-10"):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text, folder
    again = cli("to-hf", str(dump / "checkpoint"), str(out), "--follow", *DEBUG_MODEL)
    assert again.returncode == 0 and "0 step(s) exported" in again.stdout  # none twice
    # A follower restarted after a kill: its half-written export is removed, and the steps it
    # can no longer export (deleted by retention meanwhile: 5-8 here) are said, not skipped.
    for s in range(5, 11):
        shutil.rmtree(out / f"step-{s}")
    (out / ".tmp-step-5").mkdir()
    (out / ".tmp-step-5" / "model.safetensors").write_bytes(b"half")
    with caplog.at_level(logging.INFO, logger="dcpkit"):
        again = cli("to-hf", str(dump / "checkpoint"), str(out), "--follow", *DEBUG_MODEL)
    assert again.returncode == 0 and "2 step(s) exported" in again.stdout, again.stderr
    assert "left by an interrupted export" in caplog.text and not (out / ".tmp-step-5").exists()
    gap = "newest export is step-4 and the run's next step is step-9"
    assert gap in caplog.text and gap in again.stdout, again.stdout  # a note of step-9's export


def _scenario(
    dump: Path, folder: str, mode: str, reader: bool, steps: int, stop: int | None = None
) -> dict:
    """The reference trainer on 2 ranks, ``steps`` steps (stopped after ``stop`` if given: the
    schedule of ``steps``), each saved, keep_latest_k 2; beside it
    the evaluation example taking `latest` again and again (verify, to-hf, from_pretrained). The
    example starts first and the run once it says it waits: however slowly the example starts
    on a busy machine, it reads while the run saves, never only after it ended."""
    start = time.perf_counter()
    lines: list[dict] = []
    if reader:
        store = open_store(folder if "://" in folder else dump / folder)
        evaluation = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "evaluation_job.py"), store.root,
             str(dump / "exports"), "--latest", "--batches", "100",
             "--tokenizer", str(dump / "tokenizer.json")],
            env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_low_priority,
        )  # fmt: skip
        said = ""
        while "waiting for a run to save into" not in said:
            line = evaluation.stderr.readline()
            assert line, _finish(evaluation, "evaluation")  # it ended before waiting
            said += line
    done = run_train(
        2, dump, "--training.steps", str(steps), "--checkpoint.interval", "1",
        "--checkpoint.keep_latest_k", "2", "--checkpoint.folder", folder,
        "--checkpoint.async_mode", mode, "--checkpoint.last_save_model_only", "false",
        *(["--training.stop_at_step", str(stop)] if stop else []),
    )  # fmt: skip
    log = done.stdout + done.stderr
    if reader:
        printed = _finish(evaluation, "evaluation")
        lines = [json.loads(x) for x in printed.splitlines() if x.startswith("{")]
        log += printed
    metrics = read_metrics(dump)
    saves = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    stalls = [e["stall_s"] for e in saves if e.get("event") == "save"]
    took = time.perf_counter() - start
    loss = [metrics[s]["loss"] for s in range(1, (stop or steps) + 1)]
    return {"loss": loss, "stall": stalls, "reads": lines, "seconds": took, "log": log}


def _evaluated_beside(beside: dict, steps: int, loss: list, root: str) -> None:
    """What an evaluation job beside a run of ``steps`` steps must have done: changed none of
    its losses (``loss``: the same run without it), read every step it took, verified, and let
    retention keep and then delete what it held."""
    assert beside["loss"] == loss  # bitwise: the reader changed nothing
    reads = beside["reads"]
    assert len(reads) >= 2 and all(r["verified"] for r in reads), reads
    # Reads that outlived their step's turn in retention (2 newer steps published meanwhile),
    # and the trainer's log of keeping them, then deleting them once released:
    assert any(r["newest_after"] >= r["step"] + 2 for r in reads), reads
    assert "retention keeps step" in beside["log"], beside["log"][-3000:]
    deleted = ("kept until readers released it", "which the run's retention kept while it was")
    assert any(d in beside["log"] for d in deleted)  # by the trainer, or the last reader
    assert [r["step"] for r in reads] == sorted({r["step"] for r in reads})
    assert reads[-1]["step"] == steps  # the run's last step, read after the run finished
    assert all(torch.isfinite(torch.tensor(r["eval_loss"])) for r in reads)  # from_pretrained
    store = open_store(root)
    assert store.published_steps() == [steps - 1, steps]
    assert store.list_names(HOLDS) == []


@pytest.mark.alone
def test_an_evaluation_job_beside_training_reads_every_step_it_takes(tmp_path):
    """20 steps, each saved asynchronously to a local folder, beside the same run without the
    reader: the same losses, and no save stalled by what the reader holds (``alone``: the two
    runs' stalls compared on the same idle cores)."""
    folder, mode, steps = "checkpoint", "async_with_pinned_mem", 20
    alone = _scenario(tmp_path / "alone", folder, mode, False, steps)
    beside = _scenario(tmp_path / "beside", folder, mode, True, steps)
    print(alone["seconds"], beside["seconds"], beside["reads"])
    _evaluated_beside(beside, steps, alone["loss"], str(tmp_path / "beside" / folder))
    reads = beside["reads"]  # held-out text of the run's own data: its loss falls as it trains
    assert reads[-1]["eval_loss"] < reads[0]["eval_loss"] - 0.2, reads
    # A reader never blocks a save: the stall is the save's own, whatever the reader holds.
    # (Its CPU and disk use on these 2 cores is measured in benchmarks/readers_beside.py.)
    slow = statistics.median(beside["stall"]) / statistics.median(alone["stall"])
    assert slow < 5.0, (beside["stall"], alone["stall"])  # blocking would be ~100x


def test_an_evaluation_job_beside_training_on_s3_reads_every_step_it_takes(
    tmp_path, request, reference_run
):
    """The same on SeaweedFS, 12 steps (each save uploads 73 MB on these 2 cores): the holds,
    markers and reads on S3. The losses are the reference run's (its first 12 steps, saved
    elsewhere and less often: saves change no loss); the stalls are the local test's to
    compare."""
    _on_seaweedfs(request)
    folder, stop = f"s3://{BUCKET}/eval-{tmp_path.name}/checkpoint", 12
    beside = _scenario(tmp_path / "beside", folder, "async", True, 20, stop)
    print(beside["seconds"], beside["reads"])
    reference = read_metrics(reference_run)
    loss = [reference[s]["loss"] for s in range(1, stop + 1)]
    _evaluated_beside(beside, stop, loss, folder)


def test_a_follower_of_a_run_with_a_memory_tier_reads_durable_steps_and_says_so(tmp_path):
    dump = tmp_path / "run"
    train = _start_train(
        dump, "--training.steps", "10", "--checkpoint.interval", "5",
        "--checkpoint.local_interval", "1", "--checkpoint.keep_latest_k", "2",
        "--checkpoint.last_save_model_only", "false",
        "--checkpoint.local_folder", str(tmp_path / "shm"),
    )  # fmt: skip
    while not (dump / "checkpoint" / ".dcpkit-lease").exists():
        assert train.poll() is None, train.communicate()[0][-3000:]
        time.sleep(0.1)
    follower = cli("to-hf", str(dump / "checkpoint"), str(tmp_path / "out"), "--follow",
                   *DEBUG_MODEL, "--poll", "0.2")  # fmt: skip
    _finish(train, "training")
    assert follower.returncode == 0, follower.stderr
    assert "note: this run also saves every 1 step(s) to a memory tier" in follower.stdout
    assert "readers read the durable steps of this folder only" in follower.stdout
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step-10", "step-5"]


def test_a_reader_that_may_not_write_into_the_folder_reads_without_a_hold(tmp_path, monkeypatch):
    """Read-only credentials (a bucket a job may read, not write): the reader says it holds
    nothing and reads all the same."""
    folder = tmp_path / "checkpoint"
    with _manager(str(folder), keep=0) as mgr:
        mgr.save(1)
        mgr.save(2)
    from dcpkit.storage.local import LocalStore

    plain = LocalStore.write_bytes

    def refuse(self, name, data, durable=True):
        if name.startswith(HOLDS):
            raise PermissionError(13, "Permission denied", str(self.path / name))
        return plain(self, name, data, durable)

    monkeypatch.setattr(LocalStore, "write_bytes", refuse)
    verified = cli("verify", str(folder / "latest"))
    assert verified.returncode == 0, verified.stderr
    assert f"OK: {folder / 'step-2'}" in verified.stdout
    assert "note: could not hold a step of" in verified.stdout
    by_path = cli("verify", str(folder / "step-1"))
    assert by_path.returncode == 0 and "reading without a hold" in by_path.stdout


class _Probe:
    """A user state whose load runs a callback: the writer saves while the reader loads."""

    def __init__(self, during_load=None) -> None:
        self.value, self.during_load = torch.zeros(()), during_load

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state) -> None:
        self.value = state["value"]
        if self.during_load is not None:
            self.during_load()


def test_a_load_only_job_holds_the_step_it_loads_while_the_run_saves(tmp_path, caplog):
    folder = str(tmp_path / "checkpoint")
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    config = CheckpointConfig(enable=True, folder=folder, interval=1, keep_latest_k=2)
    with (
        caplog.at_level(logging.INFO, logger="dcpkit"),
        CheckpointManager(config, "/", model, states={"probe": _Probe()}) as writer,
    ):
        writer.save(1)
        writer.save(2)

        def the_run_goes_on() -> None:
            for step in (3, 4):
                writer.save(step)
            writer.wait()
            assert writer.published_steps() == [2, 3, 4]  # 2 is being loaded: kept

        evaluation = dataclasses.replace(config, load_only=True)
        reader = CheckpointManager(
            evaluation, "/", torch.nn.Linear(8, 8), states={"probe": _Probe(the_run_goes_on)}
        )
        assert reader.load() == 2
        assert torch.equal(reader.model.parts[0].weight, model.weight)
        assert writer.published_steps() == [3, 4]  # released: deleted as retention wanted
    assert "retention keeps step 2 while 1 reader(s) hold it: load" in caplog.text


def test_crafted_hold_markers_are_ignored_not_trusted(tmp_path):
    """Markers someone else wrote into the folder: not JSON, not an object, larger than any
    hold, without a heartbeat, or expired: none holds a step, none breaks retention or list."""
    folder = tmp_path / "checkpoint"
    holds = folder / HOLDS
    holds.mkdir(parents=True)
    (holds / "hold-garbage.json").write_bytes(b"\x00\xff not json")
    (holds / "hold-list.json").write_text("[1, 2]")
    (holds / "hold-huge.json").write_text(json.dumps({"step": 1, "pad": "x" * (1 << 20)}))
    (holds / "hold-nobeat.json").write_text(json.dumps({"step": 1, "expires_s": 60}))
    old = {"step": 1, "heartbeat": time.time() - 120, "expires_s": 60, "purpose": "gone"}
    (holds / "hold-expired.json").write_text(json.dumps(old))
    with _manager(str(folder)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step)
        mgr.wait()
        assert mgr.published_steps() == [2, 3]  # step 1 deleted: no marker held it
        listing = cli("list", str(folder))
        assert listing.returncode == 0 and "held by" not in listing.stdout
