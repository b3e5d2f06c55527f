"""The suite's pool of rank processes: torch imported once, many multi-rank jobs run in them.

A torchrun launch starts three Pythons that import torch before any test code runs; the suite
launches hundreds. The pool keeps up to four worker processes (``rank_worker.py``) for the
whole session and runs each job on the first N of them, as torchrun would run it on N fresh
ones: the same environment per rank (a new rendezvous store per job), the job's output read
back as one ``CompletedProcess`` (each rank's output in rank order), status 1 if any rank
failed, as torchrun's. A rank that fails first gives the others ``GRACE_S`` to finish (torchrun
stops them at once; they may be waiting for the failed rank forever), then they are stopped and
started again. A job that kills its own process (a failpoint's SIGKILL) is what torchrun is for:
``conftest.run_train`` sends those there.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_RANKS = 4
GRACE_S = 5.0  # after a rank failed, the others' time to fail too (and say why) before a stop


def exit_status(e: SystemExit) -> int:
    """The status a process ending with ``e`` reports (a string code is printed on stderr and
    is status 1, as Python does): for code that runs a ``main`` in this process."""
    if isinstance(e.code, str):
        print(e.code, file=sys.stderr)
    return e.code if isinstance(e.code, int) else int(e.code is not None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Worker:
    def __init__(self, env: dict[str, str], log: Path, python: str) -> None:
        ours, theirs = socket.socketpair()
        with open(log, "ab") as sink:
            self.proc = subprocess.Popen(
                [python, str(HERE / "rank_worker.py"), str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
                cwd=HERE.parent,
            )
        theirs.close()
        self.sock = ours
        self.reader = ours.makefile("r")
        self.ready = False

    def wait_ready(self, deadline: float) -> None:
        if self.ready:
            return
        self.sock.settimeout(max(1.0, deadline - time.monotonic()))
        line = self.reader.readline()
        self.sock.settimeout(None)
        if not line:
            raise RuntimeError(f"a rank worker exited at start ({self.proc.wait()})")
        self.ready = True

    def send(self, job: dict) -> None:
        self.sock.sendall((json.dumps(job) + "\n").encode())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.reader.close()
        self.sock.close()


class RankPool:
    """Up to ``MAX_RANKS`` rank processes, started as jobs first need them; ``python``: the
    interpreter they run (default: this one), another environment's for its packages."""

    def __init__(
        self, env: dict[str, str], scratch: Path | None = None, python: str | None = None
    ) -> None:
        self.env, self.python = env, python or sys.executable
        self.scratch = Path(scratch or tempfile.mkdtemp(prefix="dcpkit-ranks-"))
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.workers: list[_Worker | None] = [None] * MAX_RANKS
        self.jobs = 0
        self.restarts = 0
        self.starts = 0
        self.seconds: dict[str, float] = {"start": 0.0, "train": 0.0, "script": 0.0}

    def _worker(self, rank: int) -> _Worker:
        worker = self.workers[rank]
        if worker is None or not worker.alive():
            if worker is not None:
                worker.stop()
                self.restarts += 1
            worker = _Worker(self.env, self.scratch / f"worker-{rank}.log", self.python)
            self.workers[rank] = worker
            self.starts += 1
        return worker

    def run(
        self,
        nproc: int,
        kind: str,
        target: str,
        args: list[str],
        env: dict[str, str],
        timeout: float,
        cwd: str | Path | None = None,
        plain: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run one job on ranks 0..nproc-1, as ``torchrun --standalone --nproc-per-node`` would;
        ``plain``: one process as ``python PATH`` runs it (no torchrun environment)."""
        if plain and nproc != 1:
            raise ValueError("a plain job is one process")
        if not 1 <= nproc <= MAX_RANKS:
            raise ValueError(f"the pool runs 1 to {MAX_RANKS} ranks, not {nproc}")
        workers = [self._worker(rank) for rank in range(nproc)]
        starting = time.perf_counter()
        for worker in workers:  # started together, waited for together
            worker.wait_ready(time.monotonic() + 120)
        self.seconds["start"] += time.perf_counter() - starting
        self.jobs += 1
        port = _free_port()
        folder = Path(tempfile.mkdtemp(prefix=f"job-{self.jobs}-", dir=self.scratch))
        started = time.perf_counter()
        for rank, worker in enumerate(workers):
            rank_env = (
                env
                if plain
                else {
                    **env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc),
                    "GROUP_RANK": "0",
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(nproc),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "TORCHELASTIC_RESTART_COUNT": "0",
                    "TORCHELASTIC_MAX_RESTARTS": "0",
                    "TORCHELASTIC_RUN_ID": f"pool-{self.jobs}",
                }
            )
            worker.send(
                {
                    "kind": kind,
                    "target": target,
                    "args": list(args),
                    "env": rank_env,
                    "cwd": str(cwd or os.getcwd()),
                    "stdout": str(folder / f"{rank}.out"),
                    "stderr": str(folder / f"{rank}.err"),
                }
            )
        codes = self._collect(workers, timeout)
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - started
        out = "".join((folder / f"{r}.out").read_text(errors="replace") for r in range(nproc))
        err = "".join((folder / f"{r}.err").read_text(errors="replace") for r in range(nproc))
        for name in folder.iterdir():
            name.unlink()
        folder.rmdir()
        failed = any(code != 0 for code in codes)
        proc = subprocess.CompletedProcess([kind, target, *args], int(failed), out, err)
        proc.rank_codes = codes  # type: ignore[attr-defined]
        if failed and all(code is not None and code < 0 for code in codes if code != 0):
            proc.returncode = next(code for code in codes if code != 0)  # killed by a signal
        return proc

    def _collect(self, workers: list[_Worker], timeout: float) -> list[int]:
        codes: list[int | None] = [None] * len(workers)
        selector = selectors.DefaultSelector()
        for rank, worker in enumerate(workers):
            selector.register(worker.sock, selectors.EVENT_READ, rank)
        hang = time.monotonic() + timeout
        grace = None  # set when a rank failed: the others are stopped after GRACE_S
        try:
            while any(code is None for code in codes):
                now = time.monotonic()
                if now > hang:
                    for worker in workers:
                        worker.stop()
                    raise subprocess.TimeoutExpired("rank pool job", timeout)
                if grace is not None and now > grace:
                    break
                until = min(hang, grace or hang)
                for key, _ in selector.select(timeout=max(0.01, min(1.0, until - now))):
                    rank = key.data
                    line = workers[rank].reader.readline()
                    if line:
                        codes[rank] = json.loads(line)["code"]
                    else:  # the process died: its exit status, as torchrun reports it
                        codes[rank] = workers[rank].proc.wait()
                    selector.unregister(key.fileobj)
                    if codes[rank] != 0 and grace is None:
                        grace = time.monotonic() + GRACE_S
        finally:
            selector.close()
        for rank, worker in enumerate(workers):
            if codes[rank] is None or not worker.alive():
                worker.stop()
        return [code if code is not None else -signal.SIGKILL for code in codes]

    def close(self) -> None:
        for worker in self.workers:
            if worker is not None:
                worker.stop()
        self.workers = [None] * MAX_RANKS
