"""Tests side by side under ``pytest -n`` (xdist), and the ones that must run alone.

``make test`` runs the suite in two pytest workers: while one waits on a server, a subprocess or
a fixed interval of the code under test, the other uses the cores. Most tests do not mind a
neighbour. A test that measures time or the host (a stall beside a baseline, an expiry in
seconds, a host's free memory) is marked ``@pytest.mark.alone``: ``make test`` runs those in a
second pass, one at a time; under a plain ``pytest -n``, such a test starts once the tests
running beside it have ended, and no other test starts until it has ended.

The workers agree through two lock files of the run (``flock``): every test holds ``RUN``
shared, an ``alone`` test holds it alone. ``GATE`` is taken, briefly, before ``RUN``: a test
waiting to run alone holds it, so that no new test slips in before it (it would wait forever
behind a stream of them). Without xdist, nothing is locked.

The files go to the workers heaviest first, by their seconds in the suite's last profile
(``benchmarks/results/test_profile.json``; a file it does not name counts as an average one),
instead of xdist's order by the number of tests: a file of three long tests started last would
keep one worker busy while the other has nothing left to run.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path

import pytest

_files: tuple | None = None
PROFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "test_profile.json"


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # the order below is the workers' order


def pytest_collection_modifyitems(session, config, items) -> None:
    """Files heaviest first (by the last profile), each file's tests in their own order."""
    try:
        seconds = {k: v["seconds"] for k, v in json.loads(PROFILE.read_text())["files"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return
    average = sum(seconds.values()) / max(len(seconds), 1)
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::", 1)[0], i)
    items.sort(
        key=lambda item: (
            -seconds.get(item.nodeid.split("::", 1)[0], average),
            first[item.nodeid.split("::", 1)[0]],
        )
    )


def _locks():
    global _files
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not uid:
        return None
    if _files is None:
        base = Path(tempfile.gettempdir()) / f"dcpkit-suite-{uid}"
        _files = (open(f"{base}.gate", "a+"), open(f"{base}.run", "a+"))  # noqa: SIM115
    return _files


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    locks = _locks()
    if locks is None:
        yield
        return
    gate, run = locks
    alone = item.get_closest_marker("alone") is not None
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        fcntl.flock(run, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
    finally:
        fcntl.flock(gate, fcntl.LOCK_UN)
    try:
        yield
    finally:
        fcntl.flock(run, fcntl.LOCK_UN)
