"""The ``.metadata`` of a described save (``described``), written as a stream.

A checkpoint of Llama 3 405B + AdamW at 8192 ranks holds ~23 M chunks. As DCP writes its
``.metadata``, the coordinator first receives one ``WriteResult`` per chunk from the ranks, holds
every chunk and storage entry as Python objects, and pickles them at once: tens of GiB. Here the
ranks send their write results as rows of integers (``CompactResults``: key, chunk, file, offset,
length; 28 bytes a chunk), and the coordinator writes ``.metadata`` one tensor at a time: each
tensor's chunks listed from its layout, pickled (protocol 2, each piece with a memo of its own),
appended to the file and dropped. The file is DCP's ``Metadata`` as DCP pickles it: DCP,
TorchTitan and dcpkit read it unchanged. The index of ``.metadata`` is built in the same pass.

A chunk written by no rank, or by two, fails the save naming the key: never a checkpoint that
does not hold what its metadata says.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from dcpkit.engine import metadata_pickle as mp
from dcpkit.engine.chunk_layout import Layout, chunk_number, specs
from dcpkit.formats.dcp_index_write import IndexBuilder, stored_plainly

ROW = np.dtype(
    [("key", "<i4"), ("chunk", "<i4"), ("file", "<i4"), ("offset", "<i8"), ("length", "<i8")]
)
_BATCH = 20_000
"""Chunks written per SETITEMS of tensors."""


class CompactResults:
    """One rank's write results: a row per chunk of a described DTensor, the rest as DCP's."""

    def __init__(self, files: list[str], rows: np.ndarray, others: list[Any]) -> None:
        self.files, self.rows, self.others = files, rows, others


def compact(results: list[Any], numbers: dict[str, tuple[int, tuple[int, ...], Layout]]) -> Any:
    """``results`` (a rank's ``WriteResult`` list) with the described chunks as rows."""
    files: dict[str, int] = {}
    rows, others = [], []
    for wr in results:
        found = numbers.get(wr.index.fqn)
        info = wr.storage_data
        if found is None or type(info) is not _StorageInfo or not stored_plainly(info):
            others.append(wr)
            continue
        key, size, layout = found
        number = chunk_number(size, layout, tuple(wr.index.offset))
        f = files.setdefault(info.relative_path, len(files))
        rows.append((key, number, f, info.offset, info.length))
    return CompactResults(list(files), np.array(rows, dtype=ROW), others)


class StreamedMetadata(Metadata):
    """The coordinator's metadata of a described save: every entry but the described DTensors
    (``state_dict_metadata``), and those as (key, properties, shape, layout), sorted by key (a
    key's place is its number in ``CompactResults``). The storage writer calls
    ``write_streamed``; DCP broadcasts this small object to every rank after the save."""

    def __init__(
        self,
        base: Metadata,
        dtensors: list[tuple[str, Any, tuple[int, ...], Layout]],
        order: list[str] | None = None,
    ) -> None:
        super().__init__(state_dict_metadata=base.state_dict_metadata)
        self.planner_data = base.planner_data
        self.dtensors = dtensors
        self.order = order or []
        """The keys in the coordinator's plan order (``.metadata`` lists them so, as DCP's)."""
        self._index: IndexBuilder | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_index": None, "storage_data": None}

    def encode_index(self, metadata_size: int, metadata_xxh3: str) -> bytes | None:
        """The index of the ``.metadata`` just written (None when it cannot express it)."""
        index, self._index = self._index, None
        return index.encode(metadata_size, metadata_xxh3) if index is not None else None

    def write_streamed(self, f: Any, results: list[Any], storage_meta: Any, version: str) -> None:
        """Write ``.metadata`` to ``f`` from the ranks' write results, building its index."""
        from dcpkit.dist import paused_gc

        self.storage_meta, self.version, self.storage_data = storage_meta, version, None
        rows, files, others = _merge(results)
        index: IndexBuilder | None = IndexBuilder(self.planner_data)
        write = f.write
        write(b"\x80\x02c" + b"torch.distributed.checkpoint.metadata\nMetadata\n)\x81}")
        with paused_gc():
            write(mp.string("state_dict_metadata") + b"}")
            self._write_entries(write)
            write(b"s" + mp.string("planner_data") + mp.piece(self.planner_data) + b"s")
            stored = {wr.index: wr.storage_data for wr in others}
            write(mp.string("storage_data") + b"}" + _items(stored))
            if not index.add_entries(self.state_dict_metadata, stored):  # all but described
                index = None
            write(mp.storage_header(files))
            starts = np.searchsorted(rows["key"], np.arange(len(self.dtensors) + 1))
            for number, (fqn, props, size, layout) in enumerate(self.dtensors):
                mine = rows[starts[number] : starts[number + 1]]
                offsets, sizes = specs(size, layout)
                _check_rows(fqn, mine, len(offsets))
                file_nos = mine["file"].tolist()
                at, length = mine["offset"].tolist(), mine["length"].tolist()
                key = (size, layout.mesh, layout.splits)
                write(mp.entries(fqn, key, offsets, file_nos, at, length))
                if index is not None:
                    md = TensorStorageMetadata(props, torch.Size(size), [])
                    paths = [files[n] for n in file_nos]
                    added = index.add_tensor(fqn, md, list(zip(offsets, sizes, paths, at, length)))
                    index = index if added else None
            write(b"s" + mp.string("storage_meta") + mp.piece(storage_meta) + b"s")
            write(mp.string("version") + mp.piece(version) + b"s")
        write(b"b.")  # BUILD, STOP
        self._index = index

    def _write_entries(self, write: Any) -> None:
        """``state_dict_metadata``'s entries in the order DCP's planning gives them (the
        coordinator's plan, then the keys of other ranks): runs of ordinary entries pickled,
        runs of described DTensors from templates (their header written again after an
        ordinary run, whose memo may have overwritten it)."""
        small = self.state_dict_metadata
        described = {fqn: (props, size, layout) for fqn, props, size, layout in self.dtensors}
        order = [k for k in dict.fromkeys(self.order) if k in small or k in described]
        seen = set(order)
        order += [k for k in [*small, *described] if k not in seen]
        run: dict[str, Any] = {}
        batch: list[bytes] = []
        held, header = 0, False
        for fqn in order:
            if fqn not in described:
                if batch:
                    write(mp.MARK + b"".join(batch) + mp.SETITEMS)
                    batch, held = [], 0
                run[fqn] = small[fqn]
                continue
            if run:
                write(_items(run))
                run, header = {}, False
            if not header:
                write(mp.chunk_header())
                header = True
            props, size, layout = described[fqn]
            listed = specs(size, layout)
            key = (size, layout.mesh, layout.splits)
            batch.append(mp.string(fqn) + mp.tensor(props, size, listed, key))
            held += len(listed[0])
            if held >= _BATCH:
                write(mp.MARK + b"".join(batch) + mp.SETITEMS)
                batch, held = [], 0
        if batch:
            write(mp.MARK + b"".join(batch) + mp.SETITEMS)
        if run:
            write(_items(run))


def _merge(results: list[Any]) -> tuple[np.ndarray, list[str], list[Any]]:
    """Every rank's rows (file numbers made global) in one array, sorted by key and chunk (each
    rank's rows are released as they are copied); the files; the other write results."""
    files: dict[str, int] = {}
    others: list[Any] = []
    total = sum(len(p.rows) for p in results if isinstance(p, CompactResults))
    rows = np.empty(total, ROW)
    at = 0
    for part in results:
        if not isinstance(part, CompactResults):
            others += part
            continue
        others += part.others
        n = len(part.rows)
        if n:
            remap = np.array([files.setdefault(p, len(files)) for p in part.files], np.int32)
            rows[at : at + n] = part.rows
            rows["file"][at : at + n] = remap[part.rows["file"]]
            at += n
        part.rows = np.empty(0, ROW)
    rows.sort(order=["key", "chunk"])  # in place
    return rows, list(files), others


def _check_rows(fqn: str, rows: np.ndarray, count: int) -> None:
    """Every chunk of ``fqn`` written exactly once (the rows sorted by chunk)."""
    if len(rows) != count or (count and not np.array_equal(rows["chunk"], np.arange(count))):
        raise RuntimeError(
            f"{fqn}: the ranks wrote {len(rows)} chunks of its {count}, or some twice: the "
            "save's plan and its writes differ"
        )


def _items(d: dict[Any, Any]) -> bytes:
    """The SETITEMS of ``d`` pickled (protocol 2), without the dict itself: they apply to the
    dict on top of the stack. Each piece's memo starts at 0 and only its own opcodes refer to
    it (PUT and GET carry their index at protocol 2)."""
    body = pickle.dumps(d, protocol=2)[2:-1]
    if body[1:2] == b"q":  # EMPTY_DICT, BINPUT i
        return body[3:]
    return body[6:] if body[1:2] == b"r" else body[1:]  # LONG_BINPUT i
