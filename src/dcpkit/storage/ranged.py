"""Remote files read by ranges: what a DCP reader will walk, streamed ahead of it in parallel
(see ``dcpkit.storage.transfer``)."""

from __future__ import annotations

import bisect
import collections
import contextlib
import io
from concurrent.futures import Future
from typing import Any

from dcpkit.storage.transfer import (
    HEAD,
    READ_PART,
    READS_IN_FLIGHT,
    WINDOWS_AHEAD,
    WINDOWS_BEHIND,
    Transport,
    pool,
)


class RangeFile(io.RawIOBase):
    """A remote file read by a DCP reader: ``spans`` (sorted, disjoint ``(start, end)`` byte
    ranges) are streamed in order, ``in_flight`` parts ahead; ``windows`` (small ranges) are
    fetched up front; a read anywhere else is a GET of its own."""

    def __init__(
        self,
        transport: Transport,
        path: str,
        size: int,
        spans: list[tuple[int, int]],
        windows: list[tuple[int, int]],
        in_flight: int,
    ) -> None:
        self.transport, self.path, self.size, self.pos = transport, path, size, 0
        self.in_flight = max(1, in_flight)
        self._parts = _cut(spans, READ_PART)
        self._next = 0  # the next part to request
        self._queue: collections.deque[tuple[int, int, Future[bytearray]]] = collections.deque()
        self._windows = [
            w for w in _merge([(max(0, a), min(size, b)) for a, b in windows]) if w[1] > w[0]
        ]
        self._starts = [a for a, _ in self._windows]
        self._fetched: dict[int, Future[bytearray]] = {}  # window index -> its bytes
        self._ahead = 0  # the next window to request
        self._windows_to(0)
        self._fill()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def _windows_to(self, index: int) -> None:
        """Windows requested up to ``WINDOWS_AHEAD`` past ``index``; those far behind it
        dropped (a parse walks the records in order)."""
        stop = min(len(self._windows), index + WINDOWS_AHEAD)
        while self._ahead < stop:
            a, b = self._windows[self._ahead]
            self._fetched[self._ahead] = pool().submit(self.transport.read, self.path, a, b)
            self._ahead += 1
        for old in [i for i in self._fetched if i < index - WINDOWS_BEHIND]:
            del self._fetched[old]

    def _window(self, pos: int, n: int) -> memoryview | None:
        i = bisect.bisect_right(self._starts, pos) - 1
        if i < 0 or pos + n > self._windows[i][1]:
            return None
        self._windows_to(i)
        future = self._fetched.get(i)
        if future is None:
            return None
        a = self._windows[i][0]
        return memoryview(future.result())[pos - a : pos - a + n]

    def _fill(self) -> None:
        while len(self._queue) < self.in_flight and self._next < len(self._parts):
            a, b = self._parts[self._next]
            self._next += 1
            self._queue.append((a, b, pool().submit(self.transport.read, self.path, a, b)))

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self.size - self.pos)
        if n <= 0:
            return 0
        pos = self.pos
        window = self._window(pos, n)
        if window is not None:
            view[:n] = window
            self.pos += n
            return n
        small = n <= HEAD  # a parse's read: from any part on its way, passing none of them
        for a, e, future in self._queue if small else ():
            if a <= pos and pos + n <= e:
                view[:n] = memoryview(future.result())[pos - a : pos - a + n]
                self.pos += n
                return n
        if not small and self._queue and self._queue[0][1] <= pos:  # parts the reader passed
            while self._queue and self._queue[0][1] <= pos:
                self._queue.popleft()[2].cancel()
            while (
                not self._queue
                and self._next < len(self._parts)
                and self._parts[self._next][1] <= pos
            ):
                self._next += 1
            self._fill()
        if self._queue and self._queue[0][0] <= pos < self._queue[0][1]:
            a, e, future = self._queue[0]
            k = min(n, e - pos)
            view[:k] = memoryview(future.result())[pos - a : pos - a + k]
            self.pos += k
            if pos + k == e:
                self._queue.popleft()
                self._fill()
            return k
        stop = pos + n  # off the streamed spans: a request of its own, up to the next part
        if self._queue and not small:
            stop = min(stop, max(self._queue[0][0], pos + 1))
        self.transport.read_into(self.path, pos, view[: stop - pos])
        self.pos = stop
        return stop - pos

    def read(self, n: int = -1) -> bytes:
        n = self.size - self.pos if n is None or n < 0 else min(n, max(0, self.size - self.pos))
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.readinto(view[got:])
            if not k:
                break
            got += k
        return bytes(buf[:got])

    def close(self) -> None:
        for *_, future in self._queue:
            future.cancel()
        for future in self._fetched.values():
            future.cancel()
        self._queue.clear()
        self._fetched.clear()
        self._next = len(self._parts)
        super().close()


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _cut(spans: list[tuple[int, int]], part: int) -> list[tuple[int, int]]:
    out = []
    for a, b in _merge(spans):
        out += [(s, min(b, s + part)) for s in range(a, b, part)]
    return out


def record_spans(
    records: list[tuple[int, int]], size: int, whole: bool
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The spans a reader streams and the windows it fetches up front, for ``torch.save``
    records at ``(offset, length)``: every byte of the file when ``whole`` (a file checksummed
    as it loads; each record is parsed when the stream reaches it, from the parts on their way),
    else the records and each one's first and last ``HEAD`` bytes as windows."""
    if whole:
        return [(0, size)], []
    windows = []
    for offset, length in records:
        windows += [(offset, offset + min(length, HEAD)), (offset + length - HEAD, offset + length)]
    return [(o, o + n) for o, n in records], windows


class RemoteFiles:
    """Opens the data files of a remote checkpoint for dcpkit's DCP reader (the protocol of
    ``dcpkit.formats.dcp_reader.LocalFiles``): each a ``RangeFile`` streaming what the reader
    will walk, the rank's ``READS_IN_FLIGHT`` parts shared between the files read at once."""

    def __init__(self, transport: Transport, folder: str, sizes: dict[str, int]) -> None:
        self.transport, self.folder, self.sizes = transport, folder, sizes
        self.parse_ahead = False  # a file read whole parses each record as the stream reaches it

    @contextlib.contextmanager
    def open(self, name: str, records: list[tuple[int, int]], whole: bool, threads: int) -> Any:
        if name not in self.sizes:
            raise FileNotFoundError(f"{self.folder}/{name}: no such object")
        size = self.sizes[name]
        spans, windows = record_spans(records, size, whole)
        in_flight = max(2, READS_IN_FLIGHT // max(1, threads))
        f = RangeFile(self.transport, f"{self.folder}/{name}", size, spans, windows, in_flight)
        try:
            yield f, f, size
        finally:
            f.close()


def remote_files(
    transport: Transport, fs: Any, folder: str, entries: list[dict[str, Any]]
) -> tuple[RemoteFiles, Any]:
    """``RemoteFiles`` of ``folder`` (``entries``: its listing, with sizes) and DCP's file
    system on ``fs``, for the rest of what DCP reads."""
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    sizes = {
        e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"])
        for e in entries
        if e.get("type") == "file"
    }
    dcp_fs = FileSystem()
    dcp_fs.fs = fs
    return RemoteFiles(transport, folder, sizes), dcp_fs
