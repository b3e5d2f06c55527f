"""Where the suite's time goes: a pytest plugin, on when ``DCPKIT_TEST_PROFILE`` names a results
file (``benchmarks/test_profile.py`` sets it), off (and free) otherwise.

For each test (setup, call and teardown together) it records the wall time and splits it by
kind of cost, each measured where it is spent:

- ``pool_start``: starting the rank pool's workers (a Python that imports torch and dcpkit);
- ``pool_train`` / ``pool_script``: multi-rank jobs on the pool, the reference trainer's runs
  and scripts (examples, ``tests/scripts``);
- ``process_start``: Python processes the test starts itself (torchrun's launcher and ranks, a
  CLI, a server), counted as they start, each costing the import time measured once per
  session, never more than the time the test waited on them;
- ``processes``: the rest of the time the test waited on those processes;
- ``sleep``: ``time.sleep`` in the test's own thread;
- ``in_process``: the remainder, the test's own compute and I/O in the pytest process.

Beside the split, ``cpu_s`` is the CPU time the whole machine spent during the test (every
process, from ``/proc/stat``) and ``idle_cores`` the cores it left idle on average: the room a
second test running beside it would have.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ENV = "DCPKIT_TEST_PROFILE"
KINDS = (
    "pool_start",
    "pool_train",
    "pool_script",
    "process_start",
    "processes",
    "sleep",
    "in_process",
)

_counters = {"sleep": 0.0, "processes": 0.0, "starts": 0}
_main = threading.main_thread()
_waiting = threading.local()


def _python_starts(args) -> int:
    """How many Pythons a command starts: torchrun's launcher and its ranks, or one."""
    argv = [str(a) for a in (args if isinstance(args, list | tuple) else [args])]
    if not argv or ("python" not in Path(argv[0]).name and Path(argv[0]).name != "dcpkit"):
        return 0
    if "torch.distributed.run" in argv:
        nproc = 1
        for i, arg in enumerate(argv):
            if arg.startswith("--nproc-per-node="):
                nproc = int(arg.split("=", 1)[1])
            elif arg == "--nproc-per-node" and i + 1 < len(argv):
                nproc = int(argv[i + 1])
        return 1 + nproc
    return 1


def _install() -> None:
    real_sleep, real_init = time.sleep, subprocess.Popen.__init__
    real_wait, real_communicate = subprocess.Popen.wait, subprocess.Popen.communicate

    def sleep(seconds):
        if threading.current_thread() is _main:
            _counters["sleep"] += max(0.0, float(seconds))
        return real_sleep(seconds)

    def init(self, args, *a, **kw):
        if threading.current_thread() is _main:
            _counters["starts"] += _python_starts(args)
        return real_init(self, args, *a, **kw)

    def timed(real):
        def wrapper(self, *a, **kw):
            if getattr(_waiting, "on", False) or threading.current_thread() is not _main:
                return real(self, *a, **kw)
            _waiting.on = True
            started = time.perf_counter()
            try:
                return real(self, *a, **kw)
            finally:
                _counters["processes"] += time.perf_counter() - started
                _waiting.on = False

        return wrapper

    time.sleep = sleep
    subprocess.Popen.__init__ = init
    subprocess.Popen.wait = timed(real_wait)
    subprocess.Popen.communicate = timed(real_communicate)


def _machine_cpu_s() -> float:
    """CPU seconds the machine has spent busy since boot (every core, every process)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return 0.0
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _import_seconds() -> float:
    """A Python start that imports torch and dcpkit's trainer: the median of three."""
    times = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-c", "import torch, dcpkit.train.trainer"],
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        times.append(time.perf_counter() - started)
    return statistics.median(times)


class Profile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict] = {}
        self.started = time.perf_counter()
        _install()
        self.import_s = _import_seconds()

    def _pool_seconds(self) -> dict[str, float]:
        conftest = sys.modules.get("conftest")
        pool = getattr(conftest, "_pool", None)
        return dict(pool.seconds) if pool is not None else {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        before_pool = self._pool_seconds()
        before = dict(_counters)
        cpu_before = _machine_cpu_s()
        started = time.perf_counter()
        yield
        wall = time.perf_counter() - started
        cpu = _machine_cpu_s() - cpu_before
        pool = self._pool_seconds()
        delta = {k: pool.get(k, 0.0) - before_pool.get(k, 0.0) for k in pool}
        waited = _counters["processes"] - before["processes"]
        starts = _counters["starts"] - before["starts"]
        start_s = min(waited, starts * self.import_s)
        kinds = {
            "pool_start": delta.get("start", 0.0),
            "pool_train": delta.get("train", 0.0),
            "pool_script": delta.get("script", 0.0),
            "process_start": start_s,
            "processes": waited - start_s,
            "sleep": _counters["sleep"] - before["sleep"],
        }
        kinds["in_process"] = max(0.0, wall - sum(kinds.values()))
        self.tests[item.nodeid] = {
            "file": item.nodeid.split("::", 1)[0],
            "seconds": round(wall, 3),
            "python_starts": starts,
            "cpu_s": round(cpu, 2),
            "kinds": {k: round(v, 3) for k, v in kinds.items()},
        }

    def pytest_sessionfinish(self, session, exitstatus):
        files: dict[str, dict] = {}
        for test in self.tests.values():
            entry = files.setdefault(
                test["file"],
                {
                    "tests": 0,
                    "seconds": 0.0,
                    "python_starts": 0,
                    "cpu_s": 0.0,
                    "kinds": dict.fromkeys(KINDS, 0.0),
                },
            )
            entry["tests"] += 1
            entry["seconds"] += test["seconds"]
            entry["python_starts"] += test["python_starts"]
            entry["cpu_s"] += test["cpu_s"]
            for kind, value in test["kinds"].items():
                entry["kinds"][kind] += value
        totals = dict.fromkeys(KINDS, 0.0)
        for entry in files.values():
            for kind in KINDS:
                totals[kind] += entry["kinds"][kind]
        conftest = sys.modules.get("conftest")
        pool = getattr(conftest, "_pool", None)
        cores = os.cpu_count() or 1
        tests_s = sum(t["seconds"] for t in self.tests.values())
        cpu_s = sum(t["cpu_s"] for t in self.tests.values())
        data = {
            "command": " ".join(["pytest", *sys.argv[1:]]),
            "cores": os.cpu_count(),
            "exit_status": int(exitstatus),
            "wall_s": round(time.perf_counter() - self.started, 1),
            "tests": len(self.tests),
            "import_s": round(self.import_s, 3),
            "python_starts": sum(t["python_starts"] for t in self.tests.values()),
            "pool": {
                "jobs": pool.jobs if pool else 0,
                "worker_starts": pool.starts if pool else 0,
                "restarts": pool.restarts if pool else 0,
            },
            "kinds_s": {k: round(v, 1) for k, v in totals.items()},
            "cpu_s": round(cpu_s, 1),
            "idle_cores": round(cores - cpu_s / tests_s, 2) if tests_s else 0.0,
            "files": {
                name: {
                    **e,
                    "seconds": round(e["seconds"], 1),
                    "cpu_s": round(e["cpu_s"], 1),
                    "idle_cores": round(cores - e["cpu_s"] / e["seconds"], 2)
                    if e["seconds"]
                    else 0.0,
                    "kinds": {k: round(v, 1) for k, v in e["kinds"].items()},
                }
                for name, e in sorted(files.items(), key=lambda kv: -kv[1]["seconds"])
            },
            "slowest": sorted(
                ({"test": k, **v} for k, v in self.tests.items()),
                key=lambda t: -t["seconds"],
            )[:40],
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data, indent=1) + "\n")


def pytest_configure(config) -> None:
    path = os.environ.get(ENV)
    if path and not hasattr(config, "_dcpkit_profile"):
        config._dcpkit_profile = Profile(Path(path))
        config.pluginmanager.register(config._dcpkit_profile, "dcpkit-profile")
