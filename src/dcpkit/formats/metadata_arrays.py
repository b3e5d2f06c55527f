"""A ``.metadata`` of millions of chunks read into arrays, for the tools that only look at it.

``pickle`` builds DCP's ``Metadata`` as objects: at 405B over 8192 ranks 16.6 M chunks, each a
``ChunkStorageMetadata`` of two ``torch.Size`` and a ``MetadataIndex -> _StorageInfo`` entry,
about 17 times the file in memory (tens of GiB). ``verify``, ``list`` and ``inspect`` keep
nothing of a chunk once they have checked it, so here the same restricted unpickler resolves
DCP's chunk and storage classes to stand-ins that append each one's fields to integer arrays as
it is built and leave one shared object in its place: the chunk lists and the storage dict hold
that one object, and what stays is about 90 bytes a chunk (2-D tensors) - the arrays - with no
object per chunk.

The result answers as DCP's ``Metadata`` does: ``state_dict_metadata`` and ``storage_data``
are mappings that build one tensor's ``TensorStorageMetadata``, or one key's storage entries,
when asked, so every check runs the code it runs on a parsed ``Metadata``, one tensor at a time.

The bound holds for a stream that builds each object once, as dcpkit's streamed ``.metadata``
is written (``engine/metadata_pickle``). DCP's own pickle memoizes every object it writes, and
the unpickler keeps what it memoized (each chunk's state) to the end of the file: its objects
are smaller here, but not gone. A stream whose chunks or storage entries are not in the order
DCP writes them (a chunk outside a tensor's list, an entry's key without its value) is refused.
"""

from __future__ import annotations

import array
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

import numpy as np
import torch

from dcpkit.formats.metadata_sink import MetaStandIn, Sink, TensorStandIn, stand_ins
from dcpkit.safe_pickle import UnsafeCheckpoint, unpickle_metadata

_SMALL = 64 << 20  # a .metadata read whole when the arrays cannot take it (about 1 GiB parsed)


def read_bounded(f: BinaryIO, where: str) -> Any:
    """``.metadata`` from an open file (seekable), read into arrays (``ArrayMetadata``). One the
    arrays cannot take - objects shared through the pickle's memo, or a fault - is read whole
    by ``safe_pickle.load_metadata`` when it is small enough (up to 64 MiB), whose verdict and
    messages stand; a larger one is refused with the reason."""
    from dcpkit.safe_pickle import load_metadata

    try:
        return read_metadata_arrays(f, where)
    except UnsafeCheckpoint:
        f.seek(0, 2)
        if f.tell() > _SMALL:
            raise
    f.seek(0)
    return load_metadata(f, where)


def read_metadata_arrays(f: BinaryIO, where: str) -> ArrayMetadata:
    """``.metadata`` from an open file, as ``ArrayMetadata`` (see the module)."""
    from dcpkit.dist import paused_gc

    sink = Sink(where)
    with paused_gc():
        top = unpickle_metadata(f, stand_ins(sink), where)
    if not isinstance(top, MetaStandIn):
        raise UnsafeCheckpoint(f"{where} is not DCP metadata (it holds a {type(top).__name__})")
    if sink.pending or sink.expect_value:
        raise sink.refuse("chunks or a storage key outside the places DCP writes them")
    return ArrayMetadata(top.state if isinstance(top.__dict__.get("state"), dict) else {}, sink)


class ArrayMetadata:
    """DCP's ``Metadata`` over arrays: ``state_dict_metadata`` and ``storage_data`` build what
    is asked of them, one tensor or one key at a time."""

    def __init__(self, state: dict[str, Any], sink: Sink) -> None:
        entries = state.get("state_dict_metadata")
        if not isinstance(entries, dict):
            raise UnsafeCheckpoint(f"{sink.where} is not DCP metadata (it has no entries)")
        self.where = sink.where
        self.planner_data = state.get("planner_data")
        self.storage_meta = state.get("storage_meta")
        self.version = state.get("version")
        stored = state.get("storage_data")
        if stored is not None and not isinstance(stored, dict):
            raise sink.refuse("its storage entries are not a dict")
        self._arrays(sink)
        for key, entry in entries.items():
            if isinstance(entry, TensorStandIn) and entry.bad:
                raise UnsafeCheckpoint(
                    f"{self.where} is corrupt: the entry of {key!r} lacks its fields; restore "
                    "it, or use an earlier step"
                )
        self.state_dict_metadata = _Entries(entries, self)
        self.storage_data = _Stored(self)

    def _arrays(self, sink: Sink) -> None:
        def np_of(a: array.array, dtype: Any) -> np.ndarray:
            return np.frombuffer(a, dtype=dtype) if len(a) else np.zeros(0, dtype)

        self.c_off, self.c_size = np_of(sink.c_off, np.int64), np_of(sink.c_size, np.int64)
        self.c_dims = np_of(sink.c_dims, np.int16)
        self._keep = sink  # the arrays' buffers
        self.e_fqn, self.e_dims = np_of(sink.e_fqn, np.int32), np_of(sink.e_dims, np.int16)
        self.e_off = np_of(sink.e_off, np.int64)
        self.e_file, self.e_at = np_of(sink.e_file, np.int32), np_of(sink.e_at, np.int64)
        self.e_len = np_of(sink.e_len, np.int64)
        self.transforms = sink.transforms
        self.fqn_number = sink.fqns
        self.file_names = list(sink.files)
        # each entry's offsets start; entries grouped by key, in stream order within a key
        dims = np.maximum(self.e_dims, 0).astype(np.int64)
        self.e_start = np.concatenate([[0], np.cumsum(dims)[:-1]]) if len(dims) else dims
        self.by_fqn = np.argsort(self.e_fqn, kind="stable")
        self.fqn_bounds = np.searchsorted(
            self.e_fqn[self.by_fqn], np.arange(len(self.fqn_number) + 1)
        )
        self._last: tuple[int, dict[Any, tuple[str, int, int, int]]] | None = None

    @property
    def chunks_read(self) -> int:
        return len(self.c_dims)

    def nbytes(self) -> int:
        """The bytes its arrays hold."""
        arrays = (self.c_off, self.c_size, self.c_dims, self.e_fqn, self.e_dims, self.e_off)
        more = (self.e_file, self.e_at, self.e_len, self.e_start, self.by_fqn)
        return sum(a.nbytes for a in (*arrays, *more))

    def tensor(self, stand_in: TensorStandIn) -> Any:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            TensorStorageMetadata,
        )

        first, count = stand_in.first, stand_in.count
        dims = self.c_dims[first : first + count].astype(np.int64)
        n_off, n_size = dims // 256, dims % 256
        off_at = stand_in.off_at - int(n_off.sum())
        size_at = stand_in.size_at - int(n_size.sum())
        offs = self.c_off[off_at : stand_in.off_at].tolist()
        sizes = self.c_size[size_at : stand_in.size_at].tolist()
        chunks, i, j = [], 0, 0
        for a, b in zip(n_off.tolist(), n_size.tolist()):
            chunk = ChunkStorageMetadata(torch.Size(offs[i : i + a]), torch.Size(sizes[j : j + b]))
            chunks.append(chunk)
            i, j = i + a, j + b
        return TensorStorageMetadata(stand_in.properties, stand_in.size, chunks)

    def entries_of(self, fqn: str) -> dict[Any, tuple[str, int, int, int]]:
        """The storage entries of key ``fqn`` by their offsets (a tuple, or None): file, offset,
        length and number; the last of two with one key taking it (as in DCP's dict)."""
        number = self.fqn_number.get(fqn) if isinstance(fqn, str) else None
        if number is None:
            return {}
        last = self._last
        if last is not None and last[0] == number:
            return last[1]
        at = self.by_fqn[self.fqn_bounds[number] : self.fqn_bounds[number + 1]]
        dims = self.e_dims[at]
        names = self.file_names
        values = zip(
            [names[f] for f in self.e_file[at].tolist()],
            self.e_at[at].tolist(),
            self.e_len[at].tolist(),
            at.tolist(),
        )
        if len(dims) and (dims == dims[0]).all() and dims[0] >= 0:  # one shape: at once
            d = int(dims[0])
            offs = self.e_off[self.e_start[at][:, None] + np.arange(d)].tolist()
            keys: list[Any] = [tuple(o) for o in offs]
        else:
            keys = []
            for i, n in zip(at.tolist(), dims.tolist()):
                start = int(self.e_start[i])
                keys.append(None if n < 0 else tuple(self.e_off[start : start + n].tolist()))
        found = dict(zip(keys, values))
        self._last = (number, found)
        return found

    @staticmethod
    def info(entry: tuple[str, int, int, int], transforms: dict[int, Any]) -> Any:
        from torch.distributed.checkpoint.filesystem import _StorageInfo

        info = _StorageInfo(entry[0], entry[1], entry[2])
        if entry[3] in transforms:
            info.transform_descriptors = transforms[entry[3]]
        return info


class _Entries(Mapping[str, Any]):
    """``state_dict_metadata``: a tensor's entry built when asked (values and the rest as read)."""

    def __init__(self, entries: dict[str, Any], md: ArrayMetadata) -> None:
        self._entries, self._md = entries, md

    def __getitem__(self, key: str) -> Any:
        entry = self._entries[key]
        return self._md.tensor(entry) if isinstance(entry, TensorStandIn) else entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def tensors(self) -> Mapping[str, Any]:
        """The tensors' entries alone, each built when asked."""
        tensors = {k: e for k, e in self._entries.items() if isinstance(e, TensorStandIn)}
        return _Entries(tensors, self._md)

    def objects(self) -> list[str]:
        """The keys of the values stored as bytes."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        return [k for k, e in self._entries.items() if isinstance(e, BytesStorageMetadata)]


class _Stored(Mapping[Any, Any]):
    """``storage_data``: ``MetadataIndex -> _StorageInfo``, looked up by key and offsets."""

    def __init__(self, md: ArrayMetadata) -> None:
        self._md = md

    def _find(self, index: Any) -> tuple[str, int, int, int] | None:
        offset = getattr(index, "offset", None)
        found = self._md.entries_of(getattr(index, "fqn", None))
        return found.get(None if offset is None else tuple(offset))

    def __getitem__(self, index: Any) -> Any:
        entry = self._find(index)
        if entry is None:
            raise KeyError(index)
        return self._md.info(entry, self._md.transforms)

    def get(self, index: Any, default: Any = None) -> Any:
        entry = self._find(index)
        return default if entry is None else self._md.info(entry, self._md.transforms)

    def __contains__(self, index: object) -> bool:
        return self._find(index) is not None

    def __bool__(self) -> bool:
        return len(self._md.e_fqn) > 0

    def __iter__(self) -> Iterator[Any]:
        from torch.distributed.checkpoint.metadata import MetadataIndex

        names = sorted(self._md.fqn_number, key=self._md.fqn_number.__getitem__)
        for fqn in names:
            for offset in self.keys_of(fqn):
                yield MetadataIndex(fqn, offset)

    def keys_of(self, fqn: str) -> list[Any]:
        return list(self._md.entries_of(fqn))

    def __len__(self) -> int:
        return sum(len(self._md.entries_of(f)) for f in list(self._md.fqn_number))
