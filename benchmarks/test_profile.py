"""Where the test suite's time goes: runs pytest with the profile plugin of ``tests/profiling.py``
and writes its results file, per test file and per kind of cost.

    python benchmarks/test_profile.py [--json benchmarks/results/test_profile.json] [PYTEST ARGS]

The kinds (each measured where it is spent, see ``tests/profiling.py``): starting the rank
pool's workers; the reference trainer's runs and the scripts on the pool; Python processes a test
starts itself (their start and import, and the rest of their time); fixed sleeps; the rest, in
the pytest process. ``make test-profile`` runs it; ``benchmarks/figures.py`` renders the totals
into ``docs/contributing.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks/results/test_profile.json"))
    args, pytest_args = parser.parse_known_args(argv)
    out = Path(args.json).resolve()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env={**os.environ, "DCPKIT_TEST_PROFILE": str(out)})
    wall = time.perf_counter() - started
    if not out.is_file():
        print(f"error: pytest wrote no profile to {out} (exit {proc.returncode})", file=sys.stderr)
        return proc.returncode or 1
    data = json.loads(out.read_text())
    data["command"] = " ".join(["python", "benchmarks/test_profile.py", *(argv or sys.argv[1:])])
    data["process_wall_s"] = round(wall, 1)  # pytest's own start and collection included
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"profile of {data['tests']} tests ({wall:.0f} s) written to {out}")
    for kind, seconds in sorted(data["kinds_s"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:14s} {seconds:8.1f} s")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
