"""Reading and writing ``torch.save`` files one tensor (or one block of rows) at a time.

``torch.save`` writes a zip archive: a pickle (``data.pkl``) that refers to storages by key, and
one uncompressed record per storage (``data/0``, ``data/1``, ...). The reader parses the pickle
with an allow-list unpickler (``dcpkit.formats.torchpickle``) that turns every tensor into a
``TensorRef`` (record, dtype, offset, shape, stride) without reading its bytes; bytes are read
on demand, optionally only some rows.
The same reader opens the small ``torch.save`` archives that DCP's filesystem writer embeds in a
``.distcp`` file, through a window over the file. Writing: ``dcpkit.formats.torchfile_write``.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from dcpkit.formats.blocks import block
from dcpkit.formats.torchpickle import (  # noqa: F401  (re-exported)
    RefUnpickler,
    TensorRef,
    UnsupportedContent,
    itemsize,
)


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``f`` from ``start``."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self.length - self.pos))
        if n == 0:
            return 0
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        buf[: len(data)] = data
        self.pos += len(data)
        return len(data)


_END = struct.Struct("<4s4H2LH")  # end of central directory
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory entry
_SCAN_READ = 4096


def _data_offset(header: bytes, local: int) -> int | None:
    """Start of the bytes of the record whose local header (``header``) is at ``local``, by the
    header's own lengths (torch pads its extra field); None if it is not a local header."""
    if len(header) < 30 or header[:4] != b"PK\x03\x04":
        return None
    return local + 30 + sum(struct.unpack("<HH", header[26:30]))


def _scan_records(
    f: BinaryIO, start: int, length: int
) -> tuple[dict[str, tuple[int, int]], bytes] | None:
    """The records of the archive in ``[start, start + length)`` of ``f`` (name -> offset in the
    window, size) and the window's first bytes, from a read of its first and last 4 KiB
    (zipfile reads per record); None unless it has ``torch.save``'s layout (no comment, no
    zip64, stored records): ``_zip_records`` reads it then. Offsets and sizes are checked."""
    if length < _END.size:
        return None
    f.seek(start)
    head = f.read(min(length, _SCAN_READ))
    tail_at = max(0, length - _SCAN_READ)
    if tail_at < len(head):
        tail_at, tail = 0, head
    else:
        f.seek(start + tail_at)
        tail = f.read(length - tail_at)

    def window(at: int, n: int) -> bytes:
        for base, chunk in ((0, head), (tail_at, tail)):
            if base <= at and at + n <= base + len(chunk):
                return chunk[at - base : at - base + n]
        f.seek(start + at)
        return f.read(n)

    end = window(length - _END.size, _END.size)
    if len(end) < _END.size:
        return None
    sig, _, _, _, count, cd_size, cd_offset, comment = _END.unpack(end)
    if sig != b"PK\x05\x06" or comment or cd_offset + cd_size > length - _END.size:
        return None
    directory = window(cd_offset, cd_size)
    records: dict[str, tuple[int, int]] = {}
    at = 0
    for _ in range(count):
        entry = directory[at : at + _CENTRAL.size]
        if len(entry) < _CENTRAL.size:
            return None
        fields = _CENTRAL.unpack(entry)
        sig, method, stored, size = fields[0], fields[4], fields[8], fields[9]
        name_len, extra_len, comment_len, local = fields[10], fields[11], fields[12], fields[16]
        if sig != b"PK\x01\x02" or method != zipfile.ZIP_STORED or stored != size:
            return None
        if 0xFFFFFFFF in (stored, size, local):  # zip64
            return None
        name = directory[at + _CENTRAL.size : at + _CENTRAL.size + name_len]
        at += _CENTRAL.size + name_len + extra_len + comment_len
        data = _data_offset(window(local, 30), local)
        if data is None or len(name) < name_len or data + size > cd_offset:
            return None
        records[name.decode("utf-8", "replace")] = (data, size)
    return (records, head) if records else None


def _zip_records(f: BinaryIO, start: int, length: int) -> dict[str, tuple[int, int]]:
    """``_scan_records``' records through zipfile (any layout a zip writer may choose)."""
    try:
        archive = zipfile.ZipFile(_Window(f, start, length))
    except zipfile.BadZipFile:
        raise ValueError(
            "not a torch.save archive (legacy non-zip files are not supported; re-save "
            "it with a current torch)"
        ) from None
    records: dict[str, tuple[int, int]] = {}
    for info in archive.infolist():
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"compressed record {info.filename} is not supported")
        f.seek(start + info.header_offset)
        offset = _data_offset(f.read(30), info.header_offset)
        if offset is None:
            raise ValueError("not a zip local header")
        if offset + info.file_size > length:
            raise ValueError(f"record {info.filename} ends past the end of the file: truncated")
        records[info.filename] = (offset, info.file_size)
    return records


class TorchSaveFile:
    """A ``torch.save`` archive opened for on-demand reads (a whole file or a window of one)."""

    def __init__(
        self, f: BinaryIO, start: int = 0, length: int | None = None, trust_pickle: bool = False
    ) -> None:
        self.f = f
        self.start = start
        if length is None:
            f.seek(0, os.SEEK_END)
            length = f.tell() - start
        scanned = _scan_records(f, start, length)
        if scanned is None:  # not the plain layout torch.save writes: zipfile reads it
            records, self._head = _zip_records(f, start, length), b""
        else:
            records, self._head = scanned
        pkl = next((n for n in records if n.endswith("data.pkl")), None)
        if pkl is None:
            raise ValueError("not a torch.save archive: no data.pkl record")
        self.prefix = pkl[: -len("data.pkl")]
        # Every record is read by its stored bytes, never through zipfile, which would check a
        # CRC-32 that torch.save may have left out (``set_crc32_options(False)``): dcpkit's
        # checksums cover the files, and the pickle is parsed with an allow-list anyway.
        mine = {n: r for n, r in records.items() if n.startswith(self.prefix)}
        self._offsets = {n: offset for n, (offset, _) in mine.items()}
        self._sizes = {n: size for n, (_, size) in mine.items()}
        order_record = self.prefix + "byteorder"
        order = self._record(order_record) if order_record in self._sizes else b"little"
        if order.strip() != b"little":
            raise ValueError("big-endian torch.save files are not supported")
        self.obj = RefUnpickler(io.BytesIO(self._record(pkl)), self.prefix, trust_pickle).load()
        for name in [n for n in self._offsets if not n.startswith(self.prefix + "data/")]:
            del self._offsets[name], self._sizes[name]
        self._head = b""  # parsed: an open archive holds no bytes (a load opens thousands)

    def _record(self, record: str) -> bytes:
        """A whole (small) record's stored bytes (from the bytes the scan read, when there)."""
        offset, size = self._offsets[record], self._sizes[record]
        if offset + size <= len(self._head):
            return self._head[offset : offset + size]
        return bytes(self._read_bytes(record, 0, size))

    def read(self, ref: TensorRef, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor (a fresh CPU tensor), or only rows ``[start, stop)`` of its first dim."""
        item = itemsize(ref.dtype)
        shape = list(ref.shape)
        if rows is not None:
            if not shape:
                raise ValueError("row reads need a tensor with at least one dimension")
            shape[0] = rows[1] - rows[0]
        numel = 1
        for s in shape:
            numel *= s
        if ref.is_contiguous():
            first = ref.storage_offset + (rows[0] * ref.stride[0] if rows else 0)
            buf = self._read_bytes(ref.record, first * item, numel * item)
            return (
                _from_bytes(buf, ref.dtype).view(shape)
                if numel
                else torch.empty(shape, dtype=ref.dtype)
            )
        # A strided view: read the storage span it covers, then take the view.
        span = ref.storage_offset + 1 + sum((s - 1) * st for s, st in zip(ref.shape, ref.stride))
        full = _from_bytes(self._read_bytes(ref.record, 0, span * item), ref.dtype)
        view = full.as_strided(ref.shape, ref.stride, ref.storage_offset)
        return (view if rows is None else view[rows[0] : rows[1]]).clone()

    def read_into(
        self, ref: TensorRef, out: torch.Tensor, rows: tuple[int, int], hasher: Any = None
    ) -> bool:
        """Rows ``[start, stop)`` of ``ref`` read straight into ``out`` (contiguous, CPU, its
        dtype, those rows' shape); False (nothing read) when ``ref`` is not contiguous. With a
        ``hasher``, the bytes are read a block at a time and each block is fed to it while it
        is still in the CPU's cache (one pass over memory, not two)."""
        if not ref.is_contiguous() or not ref.shape:
            return False
        row = ref.nbytes // ref.shape[0] if ref.shape[0] else 0
        first = ref.storage_offset * itemsize(ref.dtype) + rows[0] * row
        length = (rows[1] - rows[0]) * row
        if out.numel() * out.element_size() != length:
            raise ValueError(f"{out.numel()} elements cannot hold rows {rows} of {ref.shape}")
        self._check_span(ref.record, first, length)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        if hasher is None:
            self._read_exactly(ref.record, first, view)
            return True
        self.f.seek(self.start + self._offsets[ref.record] + first)  # then block after block
        for at in range(0, length, HASH_BLOCK):
            block = view[at : at + HASH_BLOCK]
            self._read_on(ref.record, block)
            hasher.update(block)
        return True

    def storage_span(
        self, ref: TensorRef, nbytes: int, rows: tuple[int, int]
    ) -> tuple[int, int] | None:
        """(absolute file offset, bytes) of ``ref``'s whole record, when rows ``rows`` read
        contiguously (``nbytes`` of them) are exactly that record; else None."""
        if ref.storage_offset or rows[0] or nbytes != self._sizes.get(ref.record):
            return None
        return self.start + self._offsets[ref.record], nbytes

    def _check_span(self, record: str, offset: int, length: int) -> None:
        size = self._sizes.get(record)
        if size is None:
            raise ValueError(f"the archive has no record {record}")
        if offset < 0 or length < 0 or offset + length > size:
            # Never read past what the record holds (a corrupt or hostile pickle).
            raise ValueError(
                f"a tensor claims bytes {offset} to {offset + length} of record {record}, which "
                f"holds {size}: the file is corrupt"
            )

    def _read_bytes(self, record: str, offset: int, length: int) -> bytearray | memoryview:
        # Checked first: never allocate what the file does not hold (a corrupt or hostile pickle).
        self._check_span(record, offset, length)
        buf = block(length)
        self._read_exactly(record, offset, buf)
        return buf

    def _read_exactly(self, record: str, offset: int, buf: Any) -> None:
        """Fill ``buf`` from ``offset`` of ``record``."""
        self.f.seek(self.start + self._offsets[record] + offset)
        self._read_on(record, memoryview(buf).cast("B"))

    def _read_on(self, record: str, view: memoryview) -> None:
        """Fill ``view`` from where the file stands."""
        got = 0
        while got < len(view):
            n = self.f.readinto(view[got:])
            if not n:
                raise ValueError(f"the file ends inside record {record}: it is truncated")
            got += n


HASH_BLOCK = 1 << 20  # read, then hashed while in a core's L2 (1 MiB here; 4 MiB was slower)


def _from_bytes(buf: bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(buf, dtype=dtype) if len(buf) else torch.empty(0, dtype=dtype)


def _walk(obj: Any, leaf_type: type, fn: Callable[[str, Any], None], prefix: str) -> None:
    if isinstance(obj, leaf_type):
        fn(prefix, obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, leaf_type, fn, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, leaf_type, fn, f"{prefix}.{i}" if prefix else str(i))


def walk_refs(obj: Any, fn: Callable[[str, TensorRef], None], prefix: str = "") -> None:
    """Call ``fn(dotted_path, ref)`` for every tensor of a parsed archive, in pickle order."""
    _walk(obj, TensorRef, fn, prefix)
