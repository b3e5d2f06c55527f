"""What a virtual machine's free page reporting does to write speed, and the wait that makes
every timed operation start from the same memory.

    python benchmarks/host_memory.py [--gb 2] [--reps 3] [--json PATH]

A virtual machine whose balloon driver reports free pages (Linux ``page_reporting``, with
``virtio_balloon``) hands memory back to the host about two seconds after the guest frees it;
the next use of those pages makes the host back them again. Writing a file allocates page-cache
pages: right after a deletion freed as many, they are still backed; once the host has taken
them, the same write costs several times more. So the same save, conversion or raw write runs at
one of two speeds depending on what ran just before it: the benchmarks' "bimodal" writes.

This benchmark writes ``--gb`` GiB into the page cache (no fsync) right after deleting as many
bytes, and again after ``settle()`` (waiting until the host has taken the freed pages), in
alternating order, medians of ``--reps``; with the MiB the host took back in between. Where the
machine reports no free pages, it says so and only the first figure means anything.

``settle()`` is what ``convert.py`` calls before every operation, so that each starts from the
same state whatever ran before it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPORTED = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_kib() -> int | None:
    """KiB of free memory this machine has reported to its host so far; None if it does not."""
    try:
        return int(REPORTED.read_text())
    except (OSError, ValueError):
        return None


def settle(quiet_s: float = 3.0, limit_s: float = 30.0) -> float:
    """Wait until the host has taken back the memory the guest freed: until no page was
    reported for ``quiet_s``, at most ``limit_s`` (the guest reports in passes two seconds
    apart, here about 128 MiB each, so a large deletion takes longer than the limit). The
    seconds waited; 0 where pages are not reported."""
    last = reported_kib()
    if last is None:
        return 0.0
    start = still = time.monotonic()
    while time.monotonic() - start < limit_s:
        time.sleep(0.25)
        now = reported_kib()
        if now != last:
            last, still = now, time.monotonic()
        elif time.monotonic() - still >= quiet_s:
            break
    return time.monotonic() - start


def _write(path: Path, nbytes: int, block: bytes) -> float:
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="GiB written each time")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a temp folder)")
    opts = parser.parse_args()
    block = os.urandom(64 << 20)
    nbytes = max(1, round(opts.gb * (1 << 30) / len(block))) * len(block)
    gib = nbytes / (1 << 30)
    if reported_kib() is None:
        print("this machine reports no free pages to a host: writes do not depend on it")
    with tempfile.TemporaryDirectory(prefix="dcpkit-host-", dir=opts.workdir) as tmp:
        path = Path(tmp) / "data.bin"
        _write(path, nbytes, block)  # the bytes every timed write deletes first
        times: dict[str, list[float]] = {"after_delete_s": [], "after_settle_s": []}
        taken: list[int] = []
        for rep in range(opts.reps):
            order = ["after_delete_s", "after_settle_s"]
            for kind in order if rep % 2 == 0 else order[::-1]:
                path.unlink()
                if kind == "after_settle_s":
                    before = reported_kib()
                    settle()
                    after = reported_kib()
                    if before is not None and after is not None:
                        taken.append((after - before) >> 10)
                times[kind].append(_write(path, nbytes, block))
    result = {k: statistics.median(v) for k, v in times.items()}
    result.update(gib=gib, host_took_mib=statistics.median(taken) if taken else None)
    print(f"{gib:.2f} GiB written into the page cache (no fsync), medians of {opts.reps}:")
    print(f"  right after deleting as many bytes: {result['after_delete_s']:.2f} s")
    note = f"the host took back {result['host_took_mib']:.0f} MiB" if taken else "none reported"
    ratio = result["after_settle_s"] / result["after_delete_s"]
    print(
        f"  once the host took back the freed memory ({note}): {result['after_settle_s']:.2f} s,"
        f" {ratio:.1f}x"
    )
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
