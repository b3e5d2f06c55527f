"""One writer per checkpoint folder: a run holds a lease; a second run on a folder in use stops
naming the holder while the first finishes unharmed; a lease whose holder is gone is taken over.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import BUCKET, CONFIG, ROOT, read_metrics, run_train, torchrun_env, use_endpoint
from dcpkit import CheckpointError
from dcpkit.engine.lease import LEASE, Lease
from dcpkit.launch import torchrun_command
from dcpkit.storage import open_store


def test_a_live_lease_is_refused_and_a_dead_one_taken_over(tmp_path, caplog):
    store = open_store(tmp_path)
    first = Lease(store, timeout_s=30)
    first.acquire()
    assert json.loads(store.read_bytes(LEASE))["run_id"] == first.record["run_id"]
    first.release()
    assert not store.exists(LEASE)
    # Another live process on this host (our parent) holds it: refused, naming it.
    record = {
        "run_id": "other",
        "host": first.record["host"],
        "pid": os.getppid(),
        "started": 0,
        "heartbeat": time.time(),
    }
    store.write_bytes(LEASE, json.dumps(record).encode())
    with pytest.raises(CheckpointError, match=rf"in use by another run .* pid {os.getppid()}"):
        Lease(store, timeout_s=30).acquire()
    with pytest.raises(CheckpointError, match="in use by another run"):
        Lease(store, timeout_s=30).check()
    # A holder on this host whose pid is gone: taken over at once, and said so.
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    record.update(run_id="old", pid=int(dead))
    store.write_bytes(LEASE, json.dumps(record).encode())
    with caplog.at_level(logging.WARNING, logger="dcpkit"):
        third = Lease(store, timeout_s=30)
        third.acquire()
    assert "taking over the lease" in caplog.text and "run old" in caplog.text
    third.release()
    # Another host: alive while its heartbeat is fresh, gone once it is older than the timeout.
    record.update(host="elsewhere", heartbeat=time.time())
    store.write_bytes(LEASE, json.dumps(record).encode())
    with pytest.raises(CheckpointError, match="host elsewhere"):
        Lease(store, timeout_s=30).acquire()
    record.update(heartbeat=time.time() - 31)
    store.write_bytes(LEASE, json.dumps(record).encode())
    fourth = Lease(store, timeout_s=30)
    fourth.acquire()
    fourth.release()


@pytest.mark.parametrize("kind", ["local", "seaweedfs"])
def test_two_runs_started_together_on_a_slow_store_exactly_one_takes_the_lease(
    kind, tmp_path, request
):
    """Two runs started 0.1 s apart on one folder, the store's reachability check and listings
    answered late (0.5 s for the first, 2 s for the second: the second writes long after the
    first has written and read its lease back, having found none itself): the lease is created
    only if absent, as one operation of the store (a link on a local disk, a conditional PUT on
    S3, which this SeaweedFS honours), so exactly one runs, and the other is refused naming
    it."""
    folder = str(tmp_path / "checkpoint")
    if kind == "seaweedfs":
        import s3fs

        use_endpoint(request.getfixturevalue("monkeypatch"), request.getfixturevalue("seaweedfs"))
        request.addfinalizer(s3fs.S3FileSystem.clear_instance_cache)
        folder = f"s3://{BUCKET}/race-{tmp_path.name}/checkpoint"
    script = ROOT / "tests" / "scripts" / "lease_race.py"
    runs = []
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    for delay in ("0.5", "2"):  # the second run's store answers later than the first's
        command = [sys.executable, str(script), folder, delay]
        runs.append(subprocess.Popen(command, env=torchrun_env(), text=True, **pipes))
        time.sleep(0.1)  # the second start, 0.1 s after the first
    said = [run.stdout.readline().strip() for run in runs]
    errors = [run.communicate("done\n", timeout=120)[1] for run in runs]
    won = [line.split()[1] for line in said if line.startswith("WON ")]
    refused = [line for line in said if line.startswith("REFUSED ")]
    assert len(won) == 1 and len(refused) == 1, (said, [e[-2000:] for e in errors])
    assert "is in use by another run" in refused[0] and f"run {won[0]}" in refused[0], refused
    assert not any("cannot create a file only if it is absent" in e for e in errors), errors


def _second_run_is_refused_and_a_dead_run_s_lease_taken_over(
    folder: str, tmp_path, reference_run, lease_exists
) -> None:
    """A runs alone (the reference schedule of 20 steps, stopped after step 10); B starts on A's
    folder while A runs, and must stop, A going on unharmed. A is paused (SIGSTOP to its
    launcher and ranks) from the moment its lease exists until B has ended, so B meets A
    running whatever the machine's speed: a paused process is alive, as a slow one is, and its
    lease on this host is judged by its pid. A then dies (SIGKILL) saving step 10, before it
    publishes it: its lease is left behind, held by no one. A's next start takes the lease
    over, loads step 5 and trains on, bitwise as the reference run; its clean end releases the
    lease."""
    dump_a, dump_b = tmp_path / "a", tmp_path / "b"
    last = 10
    args = ["--job.config_file", str(CONFIG), "--checkpoint.folder", folder]
    args += ["--training.stop_at_step", str(last)]
    first = subprocess.Popen(
        torchrun_command(2, [*args, "--job.dump_folder", str(dump_a)]),
        env=torchrun_env({"DCPKIT_FAILPOINT": f"before_publish:{last}:0"}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: the launcher and its ranks
    )
    deadline = time.time() + 120
    while not lease_exists():
        assert first.poll() is None, first.communicate()[0][-3000:]
        assert time.time() < deadline, "the first run took no lease in 120 s"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGSTOP)
    try:
        second = run_train(2, dump_b, "--checkpoint.folder", folder, check=False)
    finally:
        os.killpg(first.pid, signal.SIGCONT)
    out_a, _ = first.communicate(timeout=300)
    assert second.returncode != 0
    text = second.stdout + second.stderr
    assert "is in use by another run" in text and "pid" in text and "host" in text, text
    # A trained on unharmed until its death at step 10's publication
    assert first.returncode != 0, out_a[-3000:]
    assert open_store(folder).published_steps() == [5], out_a[-3000:]
    assert lease_exists()  # left behind by the dead run
    ref, got = read_metrics(reference_run), read_metrics(dump_a)
    assert [got[s]["loss"] for s in range(1, last)] == [ref[s]["loss"] for s in range(1, last)]
    proc = run_train(2, dump_a, *args[2:])  # the schedule of 20, stopped after step 10
    assert "taking over the lease" in proc.stdout and f"loaded {folder}/step-5" in proc.stdout
    got = read_metrics(dump_a)
    assert [got[s]["loss"] for s in range(1, last + 1)] == [
        ref[s]["loss"] for s in range(1, last + 1)
    ]
    assert open_store(folder).published_steps() == [5, 10]
    assert not lease_exists()  # released at the end of the run


@pytest.mark.dist
def test_one_writer_per_local_folder(reference_run, tmp_path):
    folder = str(tmp_path / "shared" / "checkpoint")
    lease = tmp_path / "shared" / "checkpoint" / LEASE
    _second_run_is_refused_and_a_dead_run_s_lease_taken_over(
        folder, tmp_path, reference_run, lease.exists
    )


@pytest.mark.dist
def test_one_writer_per_s3_folder(s3, reference_run, tmp_path):
    folder = f"s3://{BUCKET}/lease/checkpoint"

    def lease_exists() -> bool:
        s3.invalidate_cache()
        return s3.exists(f"{BUCKET}/lease/checkpoint/{LEASE}")

    _second_run_is_refused_and_a_dead_run_s_lease_taken_over(
        folder, tmp_path, reference_run, lease_exists
    )
