"""A checkpoint is data, never code: the pickles inside checkpoints read with an allow-list.

DCP writes its ``.metadata`` with ``pickle`` and reads it back with a plain ``pickle.load``;
its default load planner reads non-tensor values with ``torch.load(weights_only=False)``. Either
runs whatever code a hostile file names. Everything dcpkit reads goes through this module
instead: ``.metadata`` through an unpickler that resolves only DCP's metadata types, torch sizes,
dtypes and layouts, paths and plain containers; non-tensor values through
``torch.load(weights_only=True)``. Anything else is refused before the object it names is built,
with an error naming the file and the global it asked for.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import pickle
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch

from dcpkit.errors import CorruptCheckpoint

_DCP_METADATA_TYPES = (
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "_MEM_FORMAT_ENCODING",
)
_MAX_NAME = 4096  # longest file name a storage entry may give


class UnsafeCheckpoint(CorruptCheckpoint):
    """A checkpoint file asks for something that would run code, or is not what it claims."""


@functools.cache
def _metadata_globals() -> dict[tuple[str, str], Any]:
    import pathlib

    import torch.distributed.checkpoint.metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    allowed: dict[tuple[str, str], Any] = {
        ("torch.distributed.checkpoint.metadata", name): getattr(md, name)
        for name in _DCP_METADATA_TYPES
        if hasattr(md, name)
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype | torch.layout | torch.memory_format):
            allowed[("torch", name)] = value
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in (set, frozenset, slice, complex):
        allowed[("builtins", cls.__name__)] = cls
    allowed[("_codecs", "encode")] = __import__("codecs").encode
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals in ``allowed``; anything else is refused, naming it."""

    def __init__(self, f: BinaryIO, allowed: dict[tuple[str, str], Any], where: str) -> None:
        super().__init__(f)
        self.allowed, self.where = allowed, where

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafeCheckpoint(
                f"{self.where} asks to load {module}.{name}, which is not checkpoint data: "
                "dcpkit refuses to run code from a checkpoint (it may be hostile, or written by "
                "something other than torch.distributed.checkpoint)"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint(f"{self.where} holds a persistent reference ({pid!r})")


def unpickle_metadata(f: BinaryIO, allowed: dict[tuple[str, str], Any], where: str) -> Any:
    """What ``f`` unpickles to with only ``allowed``'s globals; any fault of the bytes is an
    ``UnsafeCheckpoint`` naming ``where``."""
    try:
        return RestrictedUnpickler(f, allowed, where).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:  # truncated or foreign bytes fail inside pickle in many ways
        raise UnsafeCheckpoint(
            f"{where} cannot be read ({type(e).__name__}: {e}); the file is truncated or "
            "corrupt: restore it, or use an earlier step"
        ) from None


def load_metadata(f: BinaryIO, where: str) -> Any:
    """DCP ``Metadata`` from an open ``.metadata`` file, without running code, checked for
    storage entries that would read outside the checkpoint folder. Parsed and checked with the
    cyclic garbage collector paused, whoever calls (a load, ``dcpkit verify``, a conversion):
    millions of objects at scale, none in a cycle (98 MiB: 18 s with its collections, 4 s)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from dcpkit.dist import paused_gc

    with paused_gc():
        metadata = unpickle_metadata(f, _metadata_globals(), where)
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(
                f"{where} is not DCP metadata (it holds a {type(metadata).__name__})"
            )
        for info in (metadata.storage_data or {}).values():
            check_file_name(getattr(info, "relative_path", None), where)
        _check_fields(metadata, where)
    return metadata


def _check_fields(metadata: Any, where: str) -> None:
    """Every entry has the fields DCP's objects are built with: a flipped byte in a field's
    name unpickles into an object that lacks it, which would fail later, far from the file."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, md in (getattr(metadata, "state_dict_metadata", None) or {}).items():
        fields = ("properties", "size", "chunks") if isinstance(md, TensorStorageMetadata) else ()
        chunks = getattr(md, "chunks", None) or []
        if any(not hasattr(md, f) for f in fields) or any(
            not (hasattr(c, "offsets") and hasattr(c, "sizes")) for c in chunks
        ):
            raise UnsafeCheckpoint(
                f"{where} is corrupt: the entry of {key!r} lacks its fields; restore it, or "
                "use an earlier step"
            )
    for info in (metadata.storage_data or {}).values():
        if not all(hasattr(info, f) for f in ("relative_path", "offset", "length")):
            raise UnsafeCheckpoint(f"{where} is corrupt: a storage entry lacks its fields")


_PLAIN_NAME = re.compile(r"^[^/\\\x00]+$")


def check_file_name(name: Any, where: str) -> str:
    """A file name a checkpoint refers to must name a file in its own folder."""
    if (
        not isinstance(name, str)
        or len(name) > _MAX_NAME
        or not _PLAIN_NAME.match(name)
        or name in (".", "..")
    ):
        raise UnsafeCheckpoint(
            f"{where} refers to the file {name!r}, outside its own folder: refused (a hostile "
            "or corrupt checkpoint)"
        )
    return name


def check_inside(folder: Path, path: Path, where: str) -> Path:
    """``path`` must stay in ``folder`` once symbolic links are followed."""
    real, root = path.resolve(), folder.resolve()
    if real != root and root not in real.parents:
        raise UnsafeCheckpoint(
            f"{where}: {path.name} is a link to {real}, outside the checkpoint folder: refused"
        )
    return path


def load_value(data: bytes | BinaryIO, where: str) -> Any:
    """A non-tensor value DCP stored with ``torch.save``: plain Python values and tensors only."""
    stream = io.BytesIO(data) if isinstance(data, bytes | bytearray) else data
    try:
        with _values_allowed():
            return torch.load(stream, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpoint(
            f"{where} is not plain data ({_refused_global(e)}); dcpkit loads only tensors and "
            "plain Python values from a checkpoint"
        ) from None
    except Exception as e:  # truncated or foreign bytes
        raise UnsafeCheckpoint(f"{where} cannot be read ({type(e).__name__}: {e})") from None


_allowed_lock = threading.Lock()
_allowed_users = 0
_allowed_added: list[Any] = []


@contextlib.contextmanager
def _values_allowed() -> Iterator[None]:
    """``value_globals()`` allowed in torch's weights-only loads while any thread of the process
    loads a value: torch keeps its allow-list process-wide, and its own ``safe_globals`` context
    removes them at its exit even while another reading thread still loads (seen as a NumPy
    array refused now and then in a load with several reading threads). Globals the process had
    allowed already stay as they were."""
    global _allowed_users, _allowed_added
    with _allowed_lock:
        if _allowed_users == 0:
            present = set(map(id, torch.serialization.get_safe_globals()))
            _allowed_added = [g for g in value_globals() if id(g) not in present]
            torch.serialization.add_safe_globals(_allowed_added)
        _allowed_users += 1
    try:
        yield
    finally:
        with _allowed_lock:
            _allowed_users -= 1
            if _allowed_users == 0:
                from torch._weights_only_unpickler import _remove_safe_globals

                _remove_safe_globals(_allowed_added)


@functools.cache
def value_globals() -> list[Any]:
    """What a state's plain values may need beyond torch's weights-only set: NumPy arrays and
    scalars of numbers, bools and strings (object arrays are refused at save)."""
    import numpy as np

    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    dtypes = {type(np.dtype(t)) for t in set(np.sctypeDict.values()) if t is not np.object_}
    allowed = [np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar]
    return allowed + sorted(dtypes, key=lambda c: c.__name__)


def _refused_global(e: Exception) -> str:
    """What torch's weights-only unpickler refused, from its long message."""
    found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(e))
    if found:
        return f"it asks to load {found.group(1)}"
    found = re.search(r"but got <class '([\w.]+)'>", str(e))
    if found:
        return f"it asks to build {found.group(1)}"
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(e).__name__


def _storage_from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


@functools.cache
def _legacy_rng_globals() -> dict[tuple[str, str], Any]:
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    allowed = {
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("_codecs", "encode"): __import__("codecs").encode,
    }
    return allowed


def load_legacy_rng(blob: bytes, where: str) -> dict[str, Any]:
    """The RNG state dcpkit 0.1 saved as a pickle of Python, NumPy and torch states: read with
    an allow-list of exactly those types (torch storages through ``weights_only``)."""
    try:
        state = RestrictedUnpickler(io.BytesIO(blob), _legacy_rng_globals(), where).load()
    except UnsafeCheckpoint:
        raise
    except Exception as e:
        raise UnsafeCheckpoint(f"{where} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= set(state):
        raise UnsafeCheckpoint(f"{where} is not an RNG state")
    return state


def safe_reader(base: type) -> type:
    """A DCP ``StorageReader`` class like ``base`` whose ``read_metadata`` runs no code. A reader
    parses its ``.metadata`` once: the caller's look at what a checkpoint holds and DCP's load
    through the same reader share it."""

    class SafeReader(base):  # type: ignore[misc, valid-type]
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:

            cached = self.__dict__.get("_safe_metadata")
            if cached is not None and cached.storage_meta.load_id == self.load_id:
                return cached
            path = self.fs.concat_path(self.path, ".metadata")
            with self.fs.create_stream(path, "rb") as f:
                return self.adopt_metadata(load_metadata(f, str(path)))

        def adopt_metadata(self, metadata: Any) -> Any:
            """Read by ``metadata``, which ``load_metadata`` parsed from this checkpoint's
            ``.metadata`` (the checks before a verified load), instead of parsing it again."""
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._safe_metadata = metadata
            return metadata

    SafeReader.__name__ = SafeReader.__qualname__ = f"Safe{base.__name__}"
    return SafeReader


_UNSEEN = object()


def _immutable(value: Any) -> bool:
    """Whether ``value`` can be shared: None, bools, numbers, strings, bytes, tuples of those."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes):
        return True
    return type(value) is tuple and all(_immutable(v) for v in value)


def safe_load_planner(everything: bool = False, keys: set[str] | None = None) -> Any:
    """DCP's default load planner, reading non-tensor values with ``weights_only=True``;
    ``everything``: DCP's planner that loads a checkpoint whole into an empty dict, built from
    its ``.metadata`` (bound its tensors' sizes by the bytes stored first); ``keys``: only
    these top-level groups of it.

    An optimizer's state holds its hyperparameters once per parameter (lr, betas, eps, ... : a
    dozen values for each), as that many byte-identical ``torch.save`` archives: a value parsed
    once is reused for the same bytes when it is immutable (numbers, strings, tuples of them),
    so a load parses a few dozen archives instead of thousands."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import (
        DefaultLoadPlanner,
        _EmptyStateDictLoadPlanner,
    )

    base = _EmptyStateDictLoadPlanner if everything else DefaultLoadPlanner

    class SafeLoadPlanner(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__(**({"keys": keys} if everything else {}))
            self.parsed: dict[bytes, Any] = {}

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            data = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
            loaded = self.parsed.get(data, _UNSEEN)
            if loaded is _UNSEEN:
                loaded = load_value(data, f"the checkpoint's value {fqn}")
                if _immutable(loaded):
                    self.parsed[data] = loaded
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafeLoadPlanner()
