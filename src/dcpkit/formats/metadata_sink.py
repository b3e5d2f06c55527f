"""The stand-ins through which a ``.metadata`` stream's chunks and storage entries reach arrays
(``formats.metadata_arrays``): DCP's per-chunk classes, resolved by the restricted unpickler
to classes that append each object's integers to a ``Sink`` as it is built and leave one
shared object in its place."""

from __future__ import annotations

import array
from typing import Any

import torch

from dcpkit.safe_pickle import UnsafeCheckpoint, _metadata_globals, check_file_name

_META = "torch.distributed.checkpoint.metadata"
_MAX_DIMS = 64


class Sink:
    """The arrays a stream's chunks and storage entries are appended to, in stream order."""

    def __init__(self, where: str) -> None:
        self.where = where
        # chunks: every chunk's offsets and sizes, flattened, and how many of each it has
        self.c_off, self.c_size = array.array("q"), array.array("q")
        self.c_dims = array.array("h")  # offsets' length * 256 + sizes' length
        self.pending = 0  # chunks appended since the last tensor took its own
        # storage entries: key (fqn number, offsets) then value (file number, offset, length)
        self.e_fqn, self.e_dims = array.array("i"), array.array("h")  # dims -1: offset None
        self.e_off = array.array("q")
        self.e_file, self.e_at, self.e_len = array.array("i"), array.array("q"), array.array("q")
        self.transforms: dict[int, Any] = {}
        self.fqns: dict[str, int] = {}
        self.files: dict[str, int] = {}
        self.expect_value = False
        self.bad_chunk = False

    def refuse(self, why: str) -> UnsafeCheckpoint:
        return UnsafeCheckpoint(
            f"{self.where} cannot be read ({why}); the file is corrupt, or not written by "
            "torch.distributed.checkpoint: restore it, or use an earlier step"
        )

    def chunk(self, state: Any) -> None:
        try:
            off, size = state["offsets"], state["sizes"]
            dims = len(off) * 256 + len(size)
            if len(off) > _MAX_DIMS or len(size) > _MAX_DIMS:
                raise self.refuse(f"a chunk of {max(len(off), len(size))} dimensions")
            self.c_off.extend(off)
            self.c_size.extend(size)
        except (KeyError, TypeError):
            self.bad_chunk = True  # its tensor's entry lacks its fields (named there)
            dims = 0
        except OverflowError:
            raise self.refuse("a chunk's offset or size does not fit 64 bits") from None
        self.c_dims.append(dims)
        self.pending += 1

    def key(self, state: Any) -> None:
        if self.expect_value:
            raise self.refuse("a storage entry's key without its value")
        try:
            fqn, off = state["fqn"], state.get("offset")
        except (KeyError, TypeError, AttributeError):
            raise UnsafeCheckpoint(
                f"{self.where} is corrupt: a storage entry lacks its fields"
            ) from None
        if not isinstance(fqn, str):
            raise self.refuse("a storage entry's key is not a string")
        number = self.fqns.setdefault(fqn, len(self.fqns))
        try:
            if off is None:
                self.e_dims.append(-1)
            else:
                if len(off) > _MAX_DIMS:
                    raise self.refuse(f"a storage entry's offset of {len(off)} dimensions")
                self.e_off.extend(off)
                self.e_dims.append(len(off))
        except TypeError:
            raise self.refuse("a storage entry's offset is not a list of integers") from None
        except OverflowError:
            raise self.refuse("a storage entry's offset does not fit 64 bits") from None
        self.e_fqn.append(number)
        self.expect_value = True

    def value(self, state: Any) -> None:
        if not self.expect_value:
            raise self.refuse("a storage entry's value without its key")
        try:
            name, at, length = state["relative_path"], state["offset"], state["length"]
        except (KeyError, TypeError):
            raise UnsafeCheckpoint(
                f"{self.where} is corrupt: a storage entry lacks its fields"
            ) from None
        number = self.files.get(name) if isinstance(name, str) else None
        if number is None:
            check_file_name(name, self.where)
            number = self.files[name] = len(self.files)
        try:
            self.e_at.append(at)
            self.e_len.append(length)
        except (TypeError, OverflowError):
            why = "a storage entry's offset or length is not a 64-bit integer"
            raise self.refuse(why) from None
        self.e_file.append(number)
        transform = state.get("transform_descriptors")
        if transform:
            self.transforms[len(self.e_file) - 1] = transform
        self.expect_value = False


class TensorStandIn:
    """Where a tensor's entry stands in: its properties and shape, and its chunks' range."""

    __slots__ = ("bad", "count", "first", "off_at", "properties", "size", "size_at")


class MetaStandIn:
    """Where ``Metadata`` stands in while the stream is read."""

    def __setstate__(self, state: Any) -> None:
        self.state = state


def stand_ins(sink: Sink) -> dict[tuple[str, str], Any]:
    """The restricted unpickler's allow-list with DCP's per-chunk classes appending to ``sink``."""

    class Chunk:
        def __new__(cls, *args: Any) -> Any:
            return one_chunk

        def __setstate__(self, state: Any) -> None:
            sink.chunk(state)

    class Key:
        def __new__(cls, *args: Any) -> Any:
            return one_key

        def __setstate__(self, state: Any) -> None:
            sink.key(state)

    class Value:
        def __new__(cls, *args: Any) -> Any:
            return one_value

        def __setstate__(self, state: Any) -> None:
            sink.value(state)

    class Tensor(TensorStandIn):
        __slots__ = ()

        def __setstate__(self, state: Any) -> None:
            state = state if isinstance(state, dict) else {}
            chunks = state.get("chunks")
            self.bad = sink.bad_chunk or any(k not in state for k in ("properties", "size"))
            if not isinstance(chunks, list):
                self.bad = True
                chunks = []
            if len(chunks) != sink.pending or any(c is not one_chunk for c in chunks):
                raise sink.refuse("a tensor's chunk list is not the chunks written before it")
            self.properties = state.get("properties")
            size = state.get("size", ())
            try:
                self.size = torch.Size(size)
            except (TypeError, ValueError, OverflowError):
                raise sink.refuse("a tensor's size is not a list of integers") from None
            self.first, self.count = len(sink.c_dims) - sink.pending, sink.pending
            self.off_at, self.size_at = len(sink.c_off), len(sink.c_size)  # ends, for now
            sink.pending, sink.bad_chunk = 0, False

    one_chunk = object.__new__(Chunk)
    one_key = object.__new__(Key)
    one_value = object.__new__(Value)
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: F401 (its name)

    allowed = dict(_metadata_globals())
    allowed[(_META, "ChunkStorageMetadata")] = Chunk
    allowed[(_META, "MetadataIndex")] = Key
    allowed[(_META, "TensorStorageMetadata")] = Tensor
    allowed[(_META, "Metadata")] = MetaStandIn
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = Value
    allowed[("torch", "Size")] = tuple  # checked as the arrays take it
    return allowed
