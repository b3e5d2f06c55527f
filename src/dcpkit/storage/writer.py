"""What every DCP storage writer of dcpkit's stores adds to torch's: the ``mid_write`` crash
point, ``torch.save`` records written without a CRC-32 (dcpkit's checksums cover them), write
results in the form the planner sends them, and a ``.metadata`` the metadata writes itself (a
save planned from the ranks' shared layout streams it)."""

from __future__ import annotations

from typing import Any

from dcpkit import dist, failpoints
from dcpkit.layout import METADATA


class CrashPointWriter:
    """Mixed into DCP's storage writers: a crash point once this rank's data is written (before
    rank 0 has written ``.metadata``)."""

    _step: int | None = None
    _kill_pid: int | None = None
    streams_metadata = True
    """A metadata with ``write_streamed`` writes ``.metadata`` itself (``finish``)."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        with dist.records_without_crc32(self.fs):
            future = super().write_data(plan, planner)  # type: ignore[misc]
            future.wait()
        failpoints.hit("mid_write", self._step, dist.rank(), self._kill_pid)
        shrink = getattr(planner, "compact_results", None)
        if shrink is None:
            return future
        from torch.futures import Future

        out: Any = Future()
        out.set_result(shrink(future.value()))
        return out

    def finish(self, metadata: Any, results: list[Any]) -> None:
        stream = getattr(metadata, "write_streamed", None)
        if stream is None:
            return super().finish(metadata, results)  # type: ignore[misc]
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        fs = self.fs  # type: ignore[attr-defined]
        tmp = fs.concat_path(self.path, f"{METADATA}.tmp")  # type: ignore[attr-defined]
        with fs.create_stream(tmp, "wb") as f:
            stream(f, results, self.storage_meta(), CURRENT_DCP_VERSION)  # type: ignore[attr-defined]
        final = fs.concat_path(self.path, METADATA)  # type: ignore[attr-defined]
        if fs.exists(final):
            fs.rm_file(final)
        fs.rename(tmp, final)
        return None
