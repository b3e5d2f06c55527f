"""What every DCP storage writer of dcpkit's stores adds to torch's: the ``mid_write`` crash
point, and ``torch.save`` records written without a CRC-32 (dcpkit's checksums cover them)."""

from __future__ import annotations

from dcpkit import dist, failpoints


class CrashPointWriter:
    """Mixed into DCP's storage writers: a crash point once this rank's data is written (before
    rank 0 has written ``.metadata``)."""

    _step: int | None = None
    _kill_pid: int | None = None

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        with dist.records_without_crc32(self.fs):
            future = super().write_data(plan, planner)  # type: ignore[misc]
            future.wait()
        failpoints.hit("mid_write", self._step, dist.rank(), self._kill_pid)
        return future
