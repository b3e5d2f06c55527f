"""Named crash points for testing what a crash leaves behind.

``DCPKIT_FAILPOINT="before_publish:10"`` makes the process that reaches the point ``before_publish``
while saving step 10 kill itself with SIGKILL: the same abrupt end as a node failure, at a chosen
moment instead of a random one. ``NAME:STEP:RANK`` restricts it to one rank;
``NAME:STEP:RANK:writer`` kills only a background writer process, not its training process.
Unset, it costs one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "DCPKIT_FAILPOINT"
POINTS = (
    "mid_write",
    "after_write",
    "before_publish",
    "mid_publish",  # a rewrite of an existing name, between its steps (storage/local.py)
    "after_publish",
    "local_write",
)


def hit(name: str, step: int, rank: int, pid: int | None = None) -> None:
    """SIGKILL this process if ``DCPKIT_FAILPOINT`` names this point. A background writer
    process passes its parent's pid: the training process is killed first, then the writer."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    parts = spec.split(":")
    if parts[0] not in POINTS:  # a misspelled point would never fire and a test would pass
        raise ValueError(f"{ENV}={spec!r}: unknown point {parts[0]!r}; known: {', '.join(POINTS)}")
    if parts[0] != name or (len(parts) > 1 and int(parts[1]) != step):
        return
    if len(parts) > 2 and parts[2] and int(parts[2]) != rank:
        return
    writer_only = len(parts) > 3 and parts[3] == "writer"
    if writer_only and pid is None:
        return  # not a writer process
    if pid is not None and pid != os.getpid() and not writer_only:
        os.kill(pid, signal.SIGKILL)
        # The writer dies with its training process, as PR_SET_PDEATHSIG makes it do a moment
        # later: now, so that no step can be published in between and the test is exact. (A
        # write that does finish in that moment publishes a complete step, which is correct.)
    os.kill(os.getpid(), signal.SIGKILL)
