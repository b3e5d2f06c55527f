"""The pickle of a ``torch.save`` archive (its ``data.pkl``), read with an allow-list: tensors
become ``TensorRef``s (where their bytes lie, not yet read), plain Python values are built, and
anything else is refused before the object it names is built."""

from __future__ import annotations

import pickle
import warnings
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch


class UnsupportedContent(ValueError):
    """The file holds something other than tensors and plain Python values."""


@dataclass(frozen=True)
class TensorRef:
    """A tensor inside a ``torch.save`` archive, not yet read."""

    record: str
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * itemsize(self.dtype)

    def is_contiguous(self) -> bool:
        expected, acc = [], 1
        for s in reversed(self.shape):
            expected.append(acc)
            acc *= s
        return all(
            st == ex or size == 1
            for st, ex, size in zip(self.stride, reversed(expected), self.shape)
        )


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_SAFE_GLOBALS: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("torch", "Size"): torch.Size,
    # Protocol-2 pickles spell bytes as _codecs.encode(str, "latin1").
    ("_codecs", "encode"): __import__("codecs").encode,
}


def _storage_dtype(storage_type: Any) -> torch.dtype:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage deprecation: we only read its dtype
        dtype = getattr(storage_type, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise UnsupportedContent(f"unknown storage type {storage_type!r}")


def _rebuild_tensor_ref(storage, storage_offset, size, stride, *_rest):  # type: ignore[no-untyped-def]
    record, dtype = storage
    return TensorRef(record, dtype, int(storage_offset), tuple(size), tuple(stride))


def _rebuild_tensor_v3_ref(storage, storage_offset, size, stride, _grad, _hooks, dtype, *_rest):  # type: ignore[no-untyped-def]
    """torch.save's spelling of a tensor whose dtype has no typed storage (uint16-64, float8):
    an untyped storage of bytes, and the dtype given apart."""
    if not isinstance(dtype, torch.dtype):
        raise UnsupportedContent(f"a tensor of unknown dtype {dtype!r}")
    record, _ = storage
    return TensorRef(record, dtype, int(storage_offset), tuple(size), tuple(stride))


_DTYPES = {n: v for n in dir(torch) if isinstance(v := getattr(torch, n, None), torch.dtype)}


class RefUnpickler(pickle.Unpickler):
    """``data.pkl`` of an archive whose records are named under ``prefix``."""

    def __init__(self, f: BinaryIO, prefix: str, trust_pickle: bool = False) -> None:
        super().__init__(f)
        self.prefix = prefix
        self.trust_pickle = trust_pickle

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return _rebuild_tensor_ref
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_tensor_v3_ref
        if module == "torch" and name.endswith("Storage") and hasattr(torch, name):
            return getattr(torch, name)
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return torch.UntypedStorage
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) in _SAFE_GLOBALS:
            return _SAFE_GLOBALS[(module, name)]
        if self.trust_pickle:  # the user wrote the file and says so: its code may run
            return super().find_class(module, name)
        raise UnsupportedContent(
            f"the file refers to {module}.{name}; only tensors and plain Python values "
            "(dicts, lists, numbers, strings, bytes) can be read without running its code "
            "(pass --trust-pickle for a file you wrote yourself)"
        )

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise UnsupportedContent(f"unsupported persistent id {pid!r}")
        _, storage_type, key, _location, _numel = pid
        dtype = (
            torch.uint8 if storage_type is torch.UntypedStorage else _storage_dtype(storage_type)
        )
        return (f"{self.prefix}data/{key}", dtype)

    def load(self) -> Any:
        """The pickled object; a damaged pickle fails inside ``pickle`` in many ways, all
        reported as one ``ValueError``."""
        try:
            return super().load()
        except (EOFError, pickle.UnpicklingError, IndexError, KeyError, TypeError) as e:
            raise ValueError(f"its pickle does not parse ({type(e).__name__}: {e})") from None
