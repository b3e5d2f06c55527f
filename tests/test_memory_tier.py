"""The memory tier: per-rank steps in node-local shared memory, replicated to a peer on another
node, chosen over the durable tier when newer and complete; two "nodes" are two torchrun
launchers with c10d rendezvous on loopback, each with its own local folder."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CONFIG, read_metrics, run_train, torchrun_env
from dcpkit.runlog import read_run

pytestmark = pytest.mark.dist

TIERS = (
    "--checkpoint.interval",
    "5",
    "--checkpoint.local_interval",
    "2",
    "--checkpoint.local_replicas",
    "1",
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(port: int, dump: Path, local: Path, *args: str, env=None) -> subprocess.Popen:
    """One "node": a torchrun launcher with one rank, meeting the other through c10d."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=dcpkit-two-nodes",
        "-m",
        "dcpkit.train",
        "--job.config_file",
        str(CONFIG),
        "--job.dump_folder",
        str(dump),
        "--checkpoint.local_folder",
        str(local),
        *args,
    ]
    return subprocess.Popen(
        cmd,
        env=torchrun_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _two_nodes(dump: Path, locals_: list[Path], *args: str, env=None, timeout=240) -> list[str]:
    port = _port()
    procs = [_node(port, dump, local, *args, env=env) for local in locals_]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # a node left hanging by its dead peer
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        outputs.append(out)
    for proc in procs:  # nothing of a killed node survives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return outputs


def test_replaced_node_resumes_from_peer_replicas_bitwise(reference_run, tmp_path):
    dump = tmp_path / "run"
    nodes = [tmp_path / "shm-a", tmp_path / "shm-b"]
    # rank 1 is killed (SIGKILL) while writing step 8 to its memory tier: step 6 is the newest
    # complete memory step, step 5 the newest durable one
    _two_nodes(dump, nodes, *TIERS, env={"DCPKIT_FAILPOINT": "local_write:8:1"}, timeout=120)
    lost = next(n for n in nodes if (n / "rank-1").is_dir())
    assert (lost / "rank-1" / "step-6").is_dir()
    shutil.rmtree(lost)  # the node is replaced: its shared memory is gone
    survivor = next(n for n in nodes if n != lost)
    assert (survivor / "replica-of-1" / "step-6").is_dir()
    assert (dump / "checkpoint" / "step-5").is_dir()
    assert not (dump / "checkpoint" / "step-10").exists()

    outputs = _two_nodes(dump, nodes, *TIERS, "--training.stop_at_step", "9")
    log = "\n".join(outputs)
    assert "loaded step 6 from the memory tier" in log, log[-3000:]
    assert "[1] from their peers' replicas" in log
    ref, got = read_metrics(reference_run), read_metrics(dump)
    assert [got[s]["loss"] for s in range(7, 10)] == [ref[s]["loss"] for s in range(7, 10)]


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory):
    """Runs whose every rank was killed (SIGKILL) writing a memory-tier step, trained once for
    the tests that read them (each copies one, ``_copy``): with a durable save every 5 steps,
    killed at step 8 (step 6 in memory, step 5 durable), and with none, killed at step 6."""
    runs = {}
    for name, failpoint, extra in (
        ("durable-5", "local_write:8", ()),
        ("memory-only", "local_write:6", ("--checkpoint.interval", "100")),
    ):
        top = tmp_path_factory.mktemp(name)
        dump, local = top / "run", top / "shm"
        args = (*TIERS, *extra, "--checkpoint.local_folder", str(local))
        proc = run_train(2, dump, *args, env={"DCPKIT_FAILPOINT": failpoint}, check=False)
        runs[name] = (proc, dump, local, extra)
    return runs


def _copy(killed_runs, name: str, into: Path):  # type: ignore[no-untyped-def]
    """One of ``killed_runs`` copied into ``into``: its output, folders and the arguments that
    resume it from there."""
    proc, dump, local, extra = killed_runs[name]
    shutil.copytree(dump, into / "run", symlinks=True)
    shutil.copytree(local, into / "shm", symlinks=True)
    args = (*TIERS, *extra, "--checkpoint.local_folder", str(into / "shm"))
    return proc, into / "run", into / "shm", args


def test_kill_during_memory_save_and_a_step_incomplete_on_one_rank(
    reference_run, killed_runs, tmp_path
):
    # every rank killed while writing step 6 to memory
    proc, dump, local, args = _copy(killed_runs, "memory-only", tmp_path)
    assert proc.returncode != 0
    kept = sorted(p.name for p in (local / "rank-0").iterdir() if p.name.startswith("step-"))
    assert kept == ["step-2", "step-4"]
    # step 4 lost on rank 1 and on its replica: it must not be chosen, step 2 is complete
    shutil.rmtree(local / "rank-1" / "step-4")
    shutil.rmtree(local / "replica-of-1" / "step-4")
    proc = run_train(2, dump, *args, "--training.stop_at_step", "6")
    assert "loaded step 2 from the memory tier" in proc.stdout, proc.stdout[-3000:]
    ref, got = read_metrics(reference_run), read_metrics(dump)
    assert [got[s]["loss"] for s in range(3, 7)] == [ref[s]["loss"] for s in range(3, 7)]
    saves = [e for e in read_run(dump).events if e.get("event") == "save"]
    assert {e["tier"] for e in saves} == {"memory", "durable"}


def test_memory_tier_at_another_world_size_uses_the_durable_tier(killed_runs, tmp_path):
    _, dump, local, args = _copy(killed_runs, "durable-5", tmp_path)
    assert (local / "rank-0" / "step-6").is_dir()  # newer than the durable step 5
    proc = run_train(1, dump, *args, "--training.stop_at_step", "6")
    assert "resuming after step 5" in proc.stdout
    assert "not used at world size 1" in proc.stdout


def _flip_a_byte_of_the_largest_data_file(step: Path) -> Path:
    """Same size, other bytes: found only by the checksums of the load that reads it."""
    data = max((p for p in step.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    return data


def test_a_memory_tier_copy_failing_its_checksums_as_it_loads_falls_back_or_stops(
    reference_run, killed_runs, tmp_path
):
    """The memory tier's data files are checksummed as the load reads them (one pass): a copy
    whose bytes changed on one rank makes every rank load the durable tier instead, which
    overwrites what was read (losses as the reference run's); with no durable checkpoint to
    load instead, the load stops with an error naming the step, never a fresh start."""
    _, dump, local, args = _copy(killed_runs, "durable-5", tmp_path / "durable")
    assert (local / "rank-1" / "step-6").is_dir() and (dump / "checkpoint" / "step-5").is_dir()
    _flip_a_byte_of_the_largest_data_file(local / "rank-1" / "step-6")
    proc = run_train(2, dump, *args, "--training.stop_at_step", "8")
    assert "memory tier step 6 failed verification as it was loaded (rank 1:" in proc.stdout
    assert "loading the durable tier's step-5 instead" in proc.stdout, proc.stdout[-3000:]
    assert "resuming after step 5" in proc.stdout
    ref, got = read_metrics(reference_run), read_metrics(dump)
    assert [got[s]["loss"] for s in range(6, 9)] == [ref[s]["loss"] for s in range(6, 9)]

    _, dump, local, args = _copy(killed_runs, "memory-only", tmp_path / "alone")
    _flip_a_byte_of_the_largest_data_file(local / "rank-0" / "step-4")
    proc = run_train(2, dump, *args, "--training.stop_at_step", "6", check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "memory tier step 4 failed verification as it was loaded (rank 0:" in out, out[-3000:]
    assert "no durable checkpoint to load instead" in out and str(local) in out


def test_back_to_back_async_saves_in_both_tiers_finish(tmp_path):
    """40 steps, an asynchronous durable save every 2 steps and a memory-tier save on every
    other step: no hang, no collective mismatch (under a timeout)."""
    dump = tmp_path / "run"
    run_train(
        2,
        dump,
        "--training.steps",
        "40",
        "--training.seq_len",
        "16",
        "--training.global_batch_size",
        "2",
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        "async",
        "--checkpoint.local_interval",
        "1",
        "--checkpoint.local_replicas",
        "1",
        "--checkpoint.local_folder",
        str(tmp_path / "shm"),
        "--checkpoint.keep_latest_k",
        "2",
        "--metrics.log_freq",
        "20",
        timeout=420,
    )
    saves = [e for e in read_run(dump).events if e.get("event") == "save"]
    assert len(saves) == 40
    assert sum(e["tier"] == "memory" for e in saves) == 20
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-38", "step-40"]


def test_sigterm_to_one_node_saves_the_same_step_on_both_and_resumes_bitwise(
    reference_run, tmp_path
):
    """Preemption of one node of two: its launcher forwards SIGTERM to its rank; both ranks
    agree on the step, save it durably and exit 75; the resume is bitwise."""
    import json
    import time

    dump = tmp_path / "run"
    nodes = [tmp_path / "shm-a", tmp_path / "shm-b"]
    args = (*TIERS, "--checkpoint.emergency_save", "true")
    port = _port()
    procs = [_node(port, dump, local, *args) for local in nodes]
    metrics = dump / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.is_file() and '"step": 3,' in metrics.read_text()):
        assert time.time() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.1)
    os.kill(procs[1].pid, signal.SIGTERM)  # the launcher of one node only
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    events = [json.loads(x) for x in metrics.read_text().splitlines()]
    stops = [e["step"] for e in events if e.get("event") == "preempted"]
    assert len(stops) == 1, "\n".join(outputs)[-3000:]
    step = stops[0]
    manifest = json.loads((dump / "checkpoint" / f"step-{step}" / "dcpkit.json").read_text())
    assert manifest["world_size"] == 2
    assert "exitcode  : 75" in "\n".join(outputs)  # the node that was not signalled
    _two_nodes(dump, nodes, *TIERS, "--training.stop_at_step", str(step + 2))
    ref, got = read_metrics(reference_run), read_metrics(dump)
    assert [got[s]["loss"] for s in range(1, step + 3)] == [
        ref[s]["loss"] for s in range(1, step + 3)
    ]
