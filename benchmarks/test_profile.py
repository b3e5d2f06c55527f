"""Where the test suite's time goes: runs pytest with the profile plugin of ``tests/profiling.py``
and writes its results file, per test file and per kind of cost. It runs the suite as ``make
test`` does, in two passes: the tests side by side, then the ``alone`` tests one at a time.

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
    out.unlink(missing_ok=True)
    paths = [a for a in pytest_args if a.startswith("tests")]
    passes = [  # as `make test` runs them: side by side, then the `alone` tests one at a time
        [*pytest_args, "-m", "not alone"],
        ["-q", "--durations=10", "-m", "alone", *paths],
    ]
    started, codes = time.perf_counter(), []
    for i, extra in enumerate(passes):
        env = {**os.environ, "DCPKIT_TEST_PROFILE": str(out)}
        env.update({"DCPKIT_TEST_PROFILE_MERGE": "1"} if i else {})
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *extra]
        codes.append(subprocess.run(command, cwd=ROOT, env=env).returncode)
    wall = time.perf_counter() - started
    code = next((c for c in codes if c not in (0, 5)), 0)  # 5: a pass had no test to run
    if not out.is_file():
        print(f"error: pytest wrote no profile to {out} (exit {codes})", file=sys.stderr)
        return code or 1
    data = json.loads(out.read_text())
    data["command"] = " ".join(["python", "benchmarks/test_profile.py", *(argv or sys.argv[1:])])
    data["process_wall_s"] = round(wall, 1)  # pytest's own starts and collections included
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"profile of {data['tests']} tests ({wall:.0f} s) written to {out}")
    for kind, seconds in sorted(data["kinds_s"].items(), key=lambda kv: -kv[1]):
        print(f"  {kind:14s} {seconds:8.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
