"""A per-key index of a DCP ``.metadata``, so that a rank's load reads only the entries of the
chunks it needs instead of unpickling the whole file.

DCP's ``.metadata`` is one pickle holding every stored chunk of every tensor: Llama 3 405B with
AdamW over 8192 ranks is 2.8 GiB, and every rank of a load unpickles all of it (minutes), to use
the few chunks that overlap its own shards. dcpkit writes beside it, at every local save, the
same entries as data: a JSON header (keys, shapes, dtypes, file names, the ``.metadata`` it was
made from) and, per tensor, its chunks as one table of 64-bit integers sorted by their offset
along one dimension. A rank binary-searches each table for the chunks overlapping its shards and
builds DCP ``Metadata`` holding only those: DCP then plans and reads exactly as from the full
file (its read items come from the chunks that overlap, and no others).

Every size and offset is checked against the bytes that are there before it is used; an index
that does not parse, or that disagrees with itself, is an error naming the file. The index is
used only when the manifest lists it and binds it to the ``.metadata`` it was made from (the
same xxh3-64), and ``dcpkit verify`` compares the two entry by entry.

Layout (little-endian): ``MAGIC``, u64 header length, the header, zero padding to 8 bytes, the
tables. A tensor's table at ``at`` (from the tables' start) is ``n`` sort keys, then ``n`` rows
of ``offsets[ndim], sizes[ndim], file, offset, length``.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import mmap
import os
import struct
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from dcpkit.layout import METADATA, METADATA_INDEX
from dcpkit.manifest import CHECKSUM_ALGORITHM
from dcpkit.safe_pickle import UnsafeCheckpoint, check_file_name

MAGIC = b"DCPKIDX1"
_MAX_HEADER = 1 << 31
_MAX_DIMS = 64
_EXTRA = 3  # file, offset, length

Region = tuple[Sequence[int], Sequence[int]]  # offsets, sizes


def _plain_properties(props: Any) -> bool:
    """What the index can say of a tensor's properties: its dtype and requires_grad (every
    tensor DCP writes from a state dict; anything else keeps the full ``.metadata``)."""
    return (
        getattr(props, "layout", torch.strided) == torch.strided
        and getattr(props, "memory_format", torch.contiguous_format) == torch.contiguous_format
        and not getattr(props, "pin_memory", False)
        and isinstance(getattr(props, "dtype", None), torch.dtype)
    )


class DcpIndex:
    """An index file; ``metadata`` builds a rank's DCP ``Metadata`` from it, reading its tables
    through a read-only mapping."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.where = str(self.path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
                raise self._bad("it does not start with a dcpkit index's magic bytes")
            (length,) = struct.unpack("<Q", head[len(MAGIC) :])
            if length > min(size - len(head), _MAX_HEADER):
                raise self._bad(f"its header claims {length} bytes; the file has {size}")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise self._bad(f"its header is not JSON ({e})") from None
            start = len(head) + length
            start += -start % 8
        self._parse_header(header, size - start)
        self._start, self._size = start, size
        self._map: mmap.mmap | None = None

    def _bad(self, why: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(
            f"{self.where} is not a usable index of the checkpoint's .metadata: {why}; "
            "restore it, or delete it and its manifest entry to load from .metadata"
        )

    def _parse_header(self, header: Any, available: int) -> None:
        try:
            if header["version"] != 1 or sys.byteorder != "little":
                raise self._bad(f"version {header['version']!r} on a {sys.byteorder}-endian host")
            bound = header["metadata"]
            self.metadata_bytes, self.metadata_xxh3 = int(bound["bytes"]), str(bound["xxh3"])
            self.files = [check_file_name(n, self.where) for n in header["files"]]
            tables = int(header["tables_bytes"])
            if not 0 <= tables <= available:
                raise self._bad(f"its tables claim {tables} bytes; {available} follow the header")
            self.entries: dict[str, dict[str, Any]] = {}
            for e in header["keys"]:
                self.entries[str(e["k"])] = self._checked_entry(e, tables)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, UnsafeCheckpoint):
                raise
            why = f"its header lacks or mistypes a field ({type(e).__name__}: {e})"
            raise self._bad(why) from None

    def _checked_entry(self, e: dict[str, Any], tables: int) -> dict[str, Any]:
        path = e.get("p")  # the key's place in the nested state dict (DCP's planner_data)
        if path is not None and not (
            isinstance(path, list) and all(type(p) in (str, int) for p in path)
        ):
            raise self._bad(f"the entry of {e['k']!r} has the path {path!r}")
        path = tuple(path) if path is not None else None
        if "b" in e:
            f, offset, length = (int(v) for v in e["b"])
            if offset < 0 or length < 0:
                what = "offset" if offset < 0 else "length"
                raise self._bad(f"{e['k']}: negative {what} for its record")
            if not 0 <= f < len(self.files):
                raise self._bad(f"the entry of {e['k']!r} is out of range")
            return {"b": (f, offset, length), "p": path}
        size = [int(s) for s in e["size"]]
        n, at, dim, top = int(e["n"]), int(e["at"]), int(e["dim"]), int(e["max"])
        ndim = len(size)
        dtype = getattr(torch, str(e["dtype"]), None)
        if min(size, default=0) < 0:
            raise self._bad(f"{e['k']}: negative size {size}")
        if not isinstance(dtype, torch.dtype) or ndim > _MAX_DIMS:
            raise self._bad(f"the entry of {e['k']!r} has dtype {e['dtype']!r}, shape {size}")
        width = 2 * ndim + _EXTRA
        if n < 0 or at < 0 or at % 8 or at + 8 * n * (1 + width) > tables:
            raise self._bad(f"the table of {e['k']!r} ({n} chunks at {at}) lies outside the file")
        if not (0 <= dim < max(ndim, 1)) or top < 0:
            raise self._bad(f"the entry of {e['k']!r} names dimension {dim}")
        return {"size": size, "dtype": dtype, "grad": bool(e["grad"]), "n": n, "at": at,
                "dim": dim, "max": top, "p": path}  # fmt: skip

    @contextlib.contextmanager
    def mapped(self) -> Iterator[None]:
        """The tables mapped read-only while inside (nested uses share one mapping)."""
        if self._map is not None:
            yield
            return
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size != self._size:
                raise self._bad("it changed size while being read")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield
        finally:
            m, self._map = self._map, None
            with contextlib.suppress(BufferError):  # a view still held: freed with it
                m.close()

    def keys(self) -> Iterable[str]:
        return self.entries.keys()

    def planner_data(self) -> dict[str, tuple[Any, ...]] | None:
        """Each key's place in the nested state dict (DCP's ``planner_data``), when the index
        records every key's (indexes written before it was recorded do not)."""
        paths = {k: e["p"] for k, e in self.entries.items()}
        return None if None in paths.values() else paths  # type: ignore[return-value]

    def stored_entries(self) -> int:
        """How many storage entries the checkpoint holds: a chunk each, a value each."""
        return sum(e.get("n", 1) for e in self.entries.values())

    def _table(self, e: dict[str, Any]) -> tuple[memoryview, memoryview, int]:
        """A tensor's sort keys and rows (flat), as 64-bit integers, and the row width."""
        assert self._map is not None
        n, width = e["n"], 2 * len(e["size"]) + _EXTRA
        start = self._start + e["at"]
        view = memoryview(self._map)
        keys = view[start : start + 8 * n].cast("q")
        rows = view[start + 8 * n : start + 8 * n * (1 + width)].cast("q")
        return keys, rows, width

    def rows(self, fqn: str, regions: list[Region] | None = None) -> list[tuple[list[int], ...]]:
        """``(offsets, sizes, [file, offset, length])`` of the chunks of ``fqn`` that overlap
        any of ``regions`` (all of them when None), each once, each checked to lie inside the
        tensor and to name a file of the index."""
        with self.mapped():
            return self._rows(fqn, regions)

    def _rows(self, fqn: str, regions: list[Region] | None) -> list[tuple[list[int], ...]]:
        e = self.entries[fqn]
        keys, flat, width = self._table(e)
        ndim, dim, shape = len(e["size"]), e["dim"], e["size"]
        n = e["n"]
        if regions is None or ndim == 0 or math.prod(shape) == 0:
            picked: Iterable[int] = range(n)
        else:
            found: set[int] = set()
            for off, sizes in regions:
                lo = bisect.bisect_right(keys, off[dim] - e["max"])
                hi = bisect.bisect_left(keys, off[dim] + sizes[dim])
                for i in range(lo, hi):
                    row = flat[i * width : i * width + 2 * ndim]
                    if all(
                        row[d] < off[d] + sizes[d] and row[d] + row[ndim + d] > off[d]
                        for d in range(ndim)
                    ):
                        found.add(i)
            picked = sorted(found)
        out = []
        for i in picked:
            row = flat[i * width : (i + 1) * width].tolist()
            offsets, sizes, extra = row[:ndim], row[ndim : 2 * ndim], row[2 * ndim :]
            if ndim and row[dim] != keys[i]:
                raise self._bad(f"the table of {fqn!r} disagrees with its sort keys")
            if extra[1] < 0 or extra[2] < 0:
                what = "offset" if extra[1] < 0 else "length"
                raise self._bad(f"{fqn}: negative {what} for the record of its chunk ({row})")
            if any(o < 0 or k < 0 or o + k > s for o, k, s in zip(offsets, sizes, shape)) or not (
                0 <= extra[0] < len(self.files)
            ):
                raise self._bad(f"a chunk of {fqn!r} ({row}) lies outside its tensor or files")
            out.append((offsets, sizes, extra))
        return out

    def metadata(
        self, wanted: dict[str, list[Region] | None] | None = None, storage: bool = True
    ) -> Any:
        """DCP ``Metadata`` of the keys of ``wanted`` (all keys when None), each tensor with the
        chunks overlapping its regions (all when None) and (``storage``) their storage entries.
        Each region must be covered by those chunks exactly once (else a load would leave part
        of it as it was)."""
        return self._build(wanted, chunks=True, entries=storage)

    def catalog(self) -> Any:
        """Every key with its shape and dtype, and no chunks: what a load looks at before it
        knows what it reads."""
        return self._build(None, chunks=False)

    def _check_cover(
        self, fqn: str, shape: list[int], rows: list[Any], regions: list[Region] | None
    ) -> None:
        """Each of ``regions`` (the whole tensor when None) covered by the chunks of ``rows``
        exactly once: no gap, no overlap."""
        from dcpkit.formats.chunks import chunk_problems

        for off, sizes in regions if regions is not None else [([0] * len(shape), shape)]:
            boxes = []
            for o, k, _ in rows:
                lo = [max(a, b) for a, b in zip(o, off)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(o, k, off, sizes)]
                if all(h > low for h, low in zip(hi, lo)):
                    at = [a - b for a, b in zip(lo, off)]
                    boxes.append(Box(at, [h - a for h, a in zip(hi, lo)]))
            found = chunk_problems(fqn, list(sizes), boxes, first=True)
            if found:
                raise self._bad(f"where this rank loads {list(sizes)} at {list(off)}, {found[0]}")

    def _build(
        self, wanted: dict[str, list[Region] | None] | None, chunks: bool, entries: bool = True
    ) -> Any:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            MetadataIndex,
            StorageMeta,
            TensorProperties,
            TensorStorageMetadata,
        )

        from dcpkit.dist import paused_gc

        keys = self.entries if wanted is None else [k for k in wanted if k in self.entries]
        state: dict[str, Any] = {}
        storage: dict[Any, Any] = {}
        with paused_gc(), self.mapped():
            for fqn in keys:
                e = self.entries[fqn]
                if "b" in e:
                    state[fqn] = BytesStorageMetadata()
                    f, offset, length = e["b"]
                    if entries:
                        storage[MetadataIndex(fqn, None)] = _StorageInfo(
                            self.files[f], offset, length
                        )
                    continue
                props = TensorProperties(dtype=e["dtype"], requires_grad=e["grad"])
                found = []
                if chunks:
                    regions = None if wanted is None else _inside(wanted[fqn], e["size"])
                    rows = self.rows(fqn, regions)
                    self._check_cover(fqn, e["size"], rows, regions)
                    for i, (offsets, sizes, (f, offset, length)) in enumerate(rows):
                        at = torch.Size(offsets)
                        found.append(ChunkStorageMetadata(offsets=at, sizes=torch.Size(sizes)))
                        if entries:
                            storage[MetadataIndex(fqn, at, i)] = _StorageInfo(
                                self.files[f], offset, length
                            )
                state[fqn] = TensorStorageMetadata(props, torch.Size(e["size"]), found)
        return Metadata(state_dict_metadata=state, storage_data=storage, storage_meta=StorageMeta())


def _inside(regions: list[Region] | None, shape: list[int]) -> list[Region] | None:
    """``regions`` when each lies inside ``shape``; else None (every chunk: DCP then reports
    that the destination's shape is not the stored one, as it does without an index)."""
    if regions is None or all(
        len(off) == len(sizes) == len(shape)
        and all(o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(off, sizes, shape))
        for off, sizes in regions
    ):
        return regions
    return None


class Box:
    """A chunk as `chunk_problems` reads one."""

    __slots__ = ("offsets", "sizes")

    def __init__(self, offsets: list[int], sizes: list[int]) -> None:
        self.offsets, self.sizes = offsets, sizes


def bound_index(
    folder: Path, manifest: dict[str, Any] | None, metadata_size: int | None = None
) -> DcpIndex | None:
    """The index in ``folder`` when the checkpoint's manifest lists it and binds it to the
    checkpoint's ``.metadata`` (size and checksum, as the index records them; the size is
    ``metadata_size``, else that of the ``.metadata`` in ``folder``); None when there is none
    to use (a checkpoint DCP or an older dcpkit wrote)."""
    files = (manifest or {}).get("files") or {}
    listed, md = files.get(METADATA_INDEX), files.get(METADATA)
    if not (isinstance(listed, dict) and isinstance(md, dict)):
        return None
    path = folder / METADATA_INDEX
    if not path.is_file():
        return None  # the manifest check reports it missing
    index = DcpIndex(path)
    size = metadata_size
    if size is None:
        with contextlib.suppress(OSError):
            size = (folder / METADATA).stat().st_size
    if (index.metadata_bytes, index.metadata_xxh3) != (size, md.get(CHECKSUM_ALGORITHM)):
        raise index._bad(
            f"it was made from a {index.metadata_bytes}-byte .metadata ({index.metadata_xxh3}), "
            f"and the manifest's is {md.get('size')} bytes ({md.get(CHECKSUM_ALGORITHM)}), "
            f"the file {'missing' if size is None else size}"
        )
    return index
