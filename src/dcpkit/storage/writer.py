"""What every DCP storage writer of dcpkit's stores adds to torch's: the ``mid_write`` crash
point, and ``torch.save`` records written without a CRC-32 (dcpkit's checksums cover them)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from dcpkit import dist, failpoints

_crc_lock = threading.Lock()
_crc_users = 0
_crc_before = True


@contextlib.contextmanager
def records_without_crc32() -> Iterator[None]:
    """``torch.save`` without a CRC-32 of every record while a checkpoint's data is written.

    DCP writes each tensor with ``torch.save``, whose CRC-32 doubles its CPU cost (1 GiB into
    the page cache: 0.44 s with it, 0.20 s without, as long as a raw write); dcpkit's per-file
    xxh3 checksums cover the same bytes, and ``torch.load`` (so DCP's own reader) does not
    check it. Torch's switch is process-wide: overlapping saves share one window (counted),
    and the setting found before the first is restored after the last. A ``torch.save`` made
    by another thread inside the window also has no CRC-32; ``torch.load`` reads it the same."""
    global _crc_users, _crc_before
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = get()
            set_(False)
        _crc_users += 1
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                set_(_crc_before)


class CrashPointWriter:
    """Mixed into DCP's storage writers: a crash point once this rank's data is written (before
    rank 0 has written ``.metadata``)."""

    _step: int | None = None
    _kill_pid: int | None = None

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        with records_without_crc32():
            future = super().write_data(plan, planner)  # type: ignore[misc]
            future.wait()
        failpoints.hit("mid_write", self._step, dist.rank(), self._kill_pid)
        return future
