"""The test suite's profile (``benchmarks/test_profile.py``), rendered for docs/contributing.md."""

from __future__ import annotations

from _format import head, para

KIND_NAMES = {
    "pool_train": "the reference trainer's runs on the rank pool",
    "pool_script": "scripts and examples on the rank pool",
    "pool_start": "starting the rank pool's workers (torch imported once each)",
    "process_start": "Python processes the tests start themselves: start and import",
    "processes": "those processes' own work (torchrun launches, the CLI, servers, builds)",
    "sleep": "`time.sleep` in the test process (polls for an event, waits for an expiry)",
    "in_process": "in the test process: compute, I/O, waiting on servers",
}


SHORT = {
    "pool_train": "trainer runs (pool)",
    "pool_script": "scripts (pool)",
    "pool_start": "pool starts",
    "process_start": "process starts",
    "processes": "child processes",
    "sleep": "sleeps",
    "in_process": "in process",
}


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _side_by_side(data: dict) -> str:
    """How many tests ran at a time, and what they kept busy."""
    processes = data.get("test_processes", 1)
    each = "one test at a time" if processes == 1 else f"{processes} tests at a time"
    if "cores_used" not in data:
        return each
    return (
        f"{each} ({_minutes(data['tests_s'])} of test time in all, keeping "
        f"{data['cores_used']:.2f} cores busy on average)"
    )


def _cpu(data: dict) -> str:
    return f" ({data['cpu']})" if data.get("cpu") else ""


def test_profile(data: dict) -> str:
    total = sum(data["kinds_s"].values())
    lines = [
        para(
            f"{data['tests']} tests in {_minutes(data['wall_s'])} of pytest on "
            f"{data['cores']} cores{_cpu(data)}, {_side_by_side(data)}; the rank pools ran "
            f"{data['pool']['jobs']} multi-rank jobs on "
            f"{data['pool']['worker_starts']} worker starts ({data['pool']['restarts']} of them "
            f"after a stopped job); the tests started {data['python_starts']} Python processes of "
            f"their own, each import of torch and dcpkit taking {data['import_s']:.1f} s."
            + ("" if data["exit_status"] == 0 else f" (pytest exited {data['exit_status']}.)")
        ).rstrip("\n"),
        "",
        *head("where the time goes", "time", "share"),
    ]
    for kind, seconds in sorted(data["kinds_s"].items(), key=lambda kv: -kv[1]):
        lines.append(f"| {KIND_NAMES[kind]} | {_minutes(seconds)} | {seconds / total:.0%} |")
    cores = "cores busy" if "cores_used" in data else None
    columns = ["test file", "tests", "time", "Python starts", *([cores] if cores else [])]
    lines += ["", *head(*columns, "most of it")]
    for name, entry in list(data["files"].items())[:15]:
        kind = max(entry["kinds"], key=entry["kinds"].get)
        busy = f" {entry['cores_used']:.2f} |" if cores else ""
        lines.append(
            f"| `{name.removeprefix('tests/')}` | {entry['tests']} | {entry['seconds']:.0f} s | "
            f"{entry['python_starts']} |{busy} {SHORT[kind]} |"
        )
    return "\n".join(lines) + "\n"
