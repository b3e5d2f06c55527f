"""Emergency save: SIGTERM (preemption) makes every rank finish its step, save it durably and exit
with code 75; the resumed run's losses are bitwise those of an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CONFIG, read_metrics, run_train, torchrun_env
from dcpkit.engine.preempt import EXIT_PREEMPTED
from dcpkit.launch import torchrun_command

pytestmark = pytest.mark.dist


def _workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes."""
    out = {}
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    for pid in map(int, children.stdout.split()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = pid
    return out


def _preempted_run(dump: Path, target: str, *overrides: str) -> tuple[int, str, int]:
    """Start 2 ranks with emergency_save; after step 3 send SIGTERM to ``target`` (``rank1``
    or ``launcher``). Returns (exit code, output, step of the emergency save)."""
    cmd = torchrun_command(
        2,
        [
            "--job.config_file",
            str(CONFIG),
            "--job.dump_folder",
            str(dump),
            "--checkpoint.interval",
            "100",
            "--checkpoint.emergency_save",
            "true",
            *overrides,
        ],
    )
    proc = subprocess.Popen(
        cmd, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    deadline = time.time() + 240
    for line in proc.stdout:
        lines.append(line)
        if "step    3 |" in line:
            if target == "launcher":
                os.kill(proc.pid, signal.SIGTERM)
            else:
                os.kill(_workers(proc.pid)[1], signal.SIGTERM)
            break
        assert time.time() < deadline, "".join(lines)
    rest, _ = proc.communicate(timeout=240)
    output = "".join(lines) + rest
    events = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    stops = [e["step"] for e in events if e.get("event") == "preempted"]
    assert len(stops) == 1, output[-3000:]
    return proc.returncode, output, stops[0]


@pytest.mark.parametrize(
    ("target", "mode"),
    [("rank1", "disabled"), ("launcher", "async")],
)
def test_sigterm_saves_one_step_everywhere_and_resumes_bitwise(
    reference_run, tmp_path, target, mode
):
    dump = tmp_path / "run"
    code, output, step = _preempted_run(dump, target, "--checkpoint.async_mode", mode)
    assert code != 0  # torchrun reports the workers' exit
    assert f"exiting with code {EXIT_PREEMPTED}" in output
    if target == "rank1":  # the launcher lists its workers' exit codes
        assert f"exitcode  : {EXIT_PREEMPTED}" in output
    assert step >= 3
    assert (dump / "checkpoint" / f"step-{step}" / "dcpkit.json").is_file()  # published
    assert not list((dump / "checkpoint").glob(".tmp-*"))
    # the resume picks up the emergency step and continues exactly
    run_train(2, dump, "--training.stop_at_step", str(step + 3))
    ref, got = read_metrics(reference_run), read_metrics(dump)
    assert [got[s]["loss"] for s in range(1, step + 4)] == [
        ref[s]["loss"] for s in range(1, step + 4)
    ]


def test_second_sigterm_ends_the_process_at_once(tmp_path):
    """A rank that gets SIGTERM twice exits 143 without waiting for the save."""
    import sys

    script = tmp_path / "twice.py"
    script.write_text(
        "import os, signal, sys, time\n"
        "from dcpkit.engine.preempt import Preemption\n"
        "p = Preemption(timeout_s=60)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.2)\n"
        "assert p.agreed()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(5)\n"
        "sys.exit(0)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 143, proc.stderr
    assert "second SIGTERM" in proc.stderr

    script.write_text(
        "import os, signal, time\n"
        "from dcpkit.engine.preempt import Preemption\n"
        "p = Preemption(timeout_s=0.5)\n"
        "print('SIGTERM AT', time.time(), flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(10)\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    ended = time.time()  # measured from the signal: the interpreter's start is not counted
    signalled = float(proc.stdout.split("SIGTERM AT")[1].split()[0])
    assert proc.returncode == 143 and ended - signalled < 8, (proc.returncode, ended - signalled)
    assert "emergency_timeout_s" in proc.stderr
