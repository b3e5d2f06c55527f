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

Beside the split, ``cpu_s`` is the CPU time the test's own processes spent (the pytest process,
the processes it started and waited for, the rank pool's workers), and ``cores_used`` that over
its wall time: the cores it kept busy on average.

Under ``pytest -n`` (xdist) each worker measures the tests it runs and sends the figures with the
test's last report; the process that collects the reports writes the results file.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ENV = "DCPKIT_TEST_PROFILE"
IMPORT_ENV = "DCPKIT_TEST_IMPORT_S"  # measured once, by the process that collects
MERGE_ENV = "DCPKIT_TEST_PROFILE_MERGE"  # set: add this pass's figures to the file's
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


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds spent so far by this process, its waited-for children (and theirs: torchrun's
    ranks), and the processes ``pids`` with their waited-for children (the rank pool's workers)."""
    own = os.times()
    total = own.user + own.system + own.children_user + own.children_system
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
    return total


def _pool_pids() -> list[int]:
    pool = getattr(sys.modules.get("conftest"), "_pool", None)
    if pool is None:
        return []
    return [w.proc.pid for w in pool.workers if w is not None and w.proc.poll() is None]


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


class Measure:
    """Measures each test in the process that runs it; the figures ride on its teardown report."""

    def __init__(self, import_s: float) -> None:
        self.import_s = import_s
        self.started: dict[str, tuple] = {}
        _install()

    @staticmethod
    def _pool_seconds() -> dict[str, float]:
        pool = getattr(sys.modules.get("conftest"), "_pool", None)
        return dict(pool.seconds) if pool is not None else {}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.started[item.nodeid] = (
            self._pool_seconds(),
            dict(_counters),
            _cpu_s(_pool_pids()),
            time.perf_counter(),
        )
        yield
        self.started.pop(item.nodeid, None)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when != "teardown" or item.nodeid not in self.started:
            return
        before_pool, before, cpu_before, started = self.started[item.nodeid]
        wall = time.perf_counter() - started
        cpu = _cpu_s(_pool_pids()) - cpu_before
        pool_now = self._pool_seconds()
        delta = {k: pool_now.get(k, 0.0) - before_pool.get(k, 0.0) for k in pool_now}
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
        pool = getattr(sys.modules.get("conftest"), "_pool", None)
        entry = {
            "file": item.nodeid.split("::", 1)[0],
            "seconds": round(wall, 3),
            "python_starts": starts,
            "cpu_s": round(cpu, 2),
            "kinds": {k: round(v, 3) for k, v in kinds.items()},
            "pool": {
                "process": os.getpid(),
                "jobs": pool.jobs if pool else 0,
                "worker_starts": pool.starts if pool else 0,
                "restarts": pool.restarts if pool else 0,
            },
        }
        report.user_properties.append(("dcpkit_profile", entry))


class Collect:
    """Gathers the tests' figures from their reports and writes the results file."""

    def __init__(self, path: Path, import_s: float) -> None:
        self.path = path
        self.import_s = import_s
        self.tests: dict[str, dict] = {}
        self.pools: dict[int, dict] = {}
        self.started = time.perf_counter()

    def pytest_runtest_logreport(self, report):
        for name, entry in getattr(report, "user_properties", ()):
            if name == "dcpkit_profile":
                entry = dict(entry)
                pool = entry.pop("pool")
                self.pools[pool["process"]] = pool
                self.tests[report.nodeid] = entry

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
        tests_s = sum(t["seconds"] for t in self.tests.values())
        cpu_s = sum(t["cpu_s"] for t in self.tests.values())
        numprocesses = getattr(session.config.option, "numprocesses", None) or 0
        data = {
            "command": " ".join(["pytest", *sys.argv[1:]]),
            "cores": os.cpu_count(),
            "cpu": cpu(),
            "test_processes": max(1, len(self.pools)) if numprocesses else 1,
            "exit_status": int(exitstatus),
            "wall_s": round(time.perf_counter() - self.started, 1),
            "tests": len(self.tests),
            "tests_s": round(tests_s, 1),
            "import_s": round(self.import_s, 3),
            "python_starts": sum(t["python_starts"] for t in self.tests.values()),
            "pool": {
                key: sum(p[key] for p in self.pools.values())
                for key in ("jobs", "worker_starts", "restarts")
            },
            "kinds_s": {k: round(v, 1) for k, v in totals.items()},
            "cpu_s": round(cpu_s, 1),
            "cores_used": round(cpu_s / tests_s, 2) if tests_s else 0.0,
            "files": {
                name: {
                    **e,
                    "seconds": round(e["seconds"], 1),
                    "cpu_s": round(e["cpu_s"], 1),
                    "cores_used": round(e["cpu_s"] / e["seconds"], 2) if e["seconds"] else 0.0,
                    "kinds": {k: round(v, 1) for k, v in e["kinds"].items()},
                }
                for name, e in sorted(files.items(), key=lambda kv: -kv[1]["seconds"])
            },
            "slowest": sorted(
                ({"test": k, **v} for k, v in self.tests.items()),
                key=lambda t: -t["seconds"],
            )[:40],
        }
        if os.environ.get(MERGE_ENV) and self.path.is_file():  # a later pass of one suite run
            data = merged(json.loads(self.path.read_text()), data)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(data, indent=1) + "\n")


def cpu() -> str:
    """The processor and its widest vector units (whether it has bfloat16 ones among them): two
    machines of 2 cores can take very different times over the same suite."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    model = next((x.split(":", 1)[1].strip() for x in text.splitlines()
                  if x.startswith("model name")), platform.machine())  # fmt: skip
    flags = next((set(x.split(":", 1)[1].split()) for x in text.splitlines()
                  if x.startswith("flags")), set())  # fmt: skip
    if "avx512f" in flags:
        units = "AVX-512" + (" with bfloat16" if "avx512_bf16" in flags else "")
    else:
        units = "AVX2, no AVX-512" if "avx2" in flags else "no AVX2"
    return f"{model}: {units}"


def merged(first: dict, then: dict) -> dict:
    """The profiles of two passes of one suite (``make test``: the tests side by side, then the
    ``alone`` ones) as one: their times, counts and kinds summed, file by file."""

    def add(a: dict, b: dict, keys: tuple) -> dict:
        return {k: round(a[k] + b[k], 3) for k in keys}

    files = {}
    for name in {**first["files"], **then["files"]}:
        a, b = first["files"].get(name), then["files"].get(name)
        if a is None or b is None:
            files[name] = a or b
            continue
        entry = add(a, b, ("tests", "seconds", "python_starts", "cpu_s"))
        entry["kinds"] = add(a["kinds"], b["kinds"], tuple(KINDS))
        entry["cores_used"] = round(entry["cpu_s"] / entry["seconds"], 2) if entry["seconds"] else 0
        files[name] = entry
    data = {**first, **add(first, then, ("wall_s", "tests", "tests_s", "python_starts", "cpu_s"))}
    data["command"] = f"{first['command']} && {then['command']}"
    data["exit_status"] = max(first["exit_status"], then["exit_status"])
    data["pool"] = add(first["pool"], then["pool"], tuple(first["pool"]))
    data["kinds_s"] = add(first["kinds_s"], then["kinds_s"], tuple(KINDS))
    data["cores_used"] = round(data["cpu_s"] / data["tests_s"], 2) if data["tests_s"] else 0.0
    data["files"] = dict(sorted(files.items(), key=lambda kv: -kv[1]["seconds"]))
    slowest = [*first["slowest"], *then["slowest"]]
    data["slowest"] = sorted(slowest, key=lambda t: -t["seconds"])[:40]
    return data


def pytest_configure(config) -> None:
    path = os.environ.get(ENV)
    if not path or hasattr(config, "_dcpkit_profile"):
        return
    worker = hasattr(config, "workerinput")  # an xdist worker: it measures, its controller collects
    if not worker:
        os.environ[IMPORT_ENV] = str(_import_seconds())  # the workers it starts read it
        config._dcpkit_collect = Collect(Path(path), float(os.environ[IMPORT_ENV]))
        config.pluginmanager.register(config._dcpkit_collect, "dcpkit-profile-collect")
    config._dcpkit_profile = Measure(float(os.environ.get(IMPORT_ENV) or _import_seconds()))
    config.pluginmanager.register(config._dcpkit_profile, "dcpkit-profile")
