"""The values a state dict may hold: which ones a checkpoint can store and read back without
running code, and a digest of their content (to tell whether every rank holds the same).

A state's tensors are written as tensors; every other value is written by DCP with
``torch.save`` and read back by dcpkit without running code (``safe_pickle.load_value``). A
value that reader cannot rebuild would save without a word and fail at the resume, when the
run that made it is gone: it is refused at the save instead, naming the state, the key and why.
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import torch
import xxhash
from torch.distributed.tensor import DTensor

from dcpkit.errors import CheckpointError

# Read back as they were saved (exact types: a subclass is another class to rebuild).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)
_PLAIN += (torch.dtype, torch.device, torch.Size)
_MAPPINGS = (dict, collections.OrderedDict, collections.Counter)
_SEQUENCES = (list, tuple, set)

_HOW = (
    "store plain values instead (tensors, NumPy arrays, numbers, strings, bytes, None, and "
    "dicts, lists, tuples and sets of them) and rebuild the object in load_state_dict()"
)


def unstorable(value: Any, path: str = "") -> tuple[str, str] | None:
    """The first value inside ``value`` that a checkpoint cannot hold safely: ``(key path,
    reason)``; None when every value can."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided:
            return path, f"a {value.layout} tensor: only dense (strided) tensors are stored"
        if value.device.type == "meta":
            return path, "a tensor on the meta device holds no data to save"
        return None
    if kind in _PLAIN:
        return None
    if isinstance(value, np.ndarray | np.generic) and kind.__module__ == "numpy":
        if value.dtype.hasobject:
            return path, f"a NumPy {kind.__name__} of dtype object holds Python objects: {_HOW}"
        return None
    if kind in _MAPPINGS:
        for key, item in value.items():
            if type(key) not in (str, int):
                return f"{path}[{key!r}]", f"its key is a {type(key).__name__}: use str or int"
            found = unstorable(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
        return None
    if kind in _SEQUENCES:
        items = sorted(value, key=repr) if kind is set else value
        for i, item in enumerate(items):
            found = unstorable(item, f"{path}[{i}]")
            if found:
                return found
        return None
    name = f"{kind.__module__}.{kind.__qualname__}"
    if isinstance(value, dict | list | tuple | set | frozenset):
        base = next(b for b in (dict, list, tuple, set, frozenset) if isinstance(value, b))
        return path, (
            f"a {name} (a {base.__name__} of another class: it reads back only by running that "
            f"class's code); store {base.__name__}(value) instead, or {_HOW}"
        )
    return path, f"a {name} reads back only by running its code: {_HOW}"


def check_storable(states: dict[str, Any]) -> None:
    """Refuse, before anything is written, a state holding a value that could not be loaded."""
    for name, value in states.items():
        found = unstorable(value)
        if found:
            key, reason = found
            where = f"states[{name!r}]" + (f", key {key!r}" if key else "")
            raise CheckpointError(
                f"{where} cannot be checkpointed: {reason}. dcpkit reads checkpoints without "
                "running code, so this value would save but fail to load at the resume"
            )


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of ``t``'s elements in row-major order, for every dtype and shape (0-dim, empty,
    non-contiguous, bool, complex, bfloat16, float8, unsigned): a view of its memory when it is
    contiguous on the CPU, a copy only when it is not."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.contiguous().reshape(-1)  # no copy when already contiguous; 0-dim -> 1 element
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy())


def fingerprint(value: Any) -> str:
    """A digest of a (nested) state dict's content: tensors and NumPy arrays by dtype, shape and
    bytes; containers by their items (sets in an order that does not depend on the process)."""
    h = xxhash.xxh3_64()

    def feed(v: Any) -> None:
        if isinstance(v, DTensor):
            h.update(b"dtensor")  # sharded on purpose: each rank holds its own shard
        elif torch.is_tensor(v):
            h.update(f"T{v.dtype}{tuple(v.shape)}".encode())
            h.update(tensor_bytes(v))
        elif isinstance(v, np.ndarray) and not v.dtype.hasobject:
            h.update(f"N{v.dtype.str}{v.shape}".encode())
            h.update(np.ascontiguousarray(v).reshape(-1).view(np.uint8).data)
        elif isinstance(v, dict):
            h.update(f"{{{type(v).__name__}{len(v)}".encode())
            for k in sorted(v, key=repr):
                h.update(repr(k).encode())
                feed(v[k])
        elif isinstance(v, set | frozenset):
            h.update(f"S{len(v)}".encode())
            for x in sorted(v, key=repr):
                feed(x)
        elif isinstance(v, list | tuple | collections.deque):
            h.update(f"[{type(v).__name__}{len(v)}".encode())
            for x in v:
                feed(x)
        else:
            h.update(f"{type(v).__name__}:{v!r}".encode())

    feed(value)
    return h.hexdigest()


def fit_to_saved(value: Any, fqn: str, saved: dict[str, Any], limit: int | None) -> Any:
    """``value`` (a live state's template) with each plain tensor whose saved shape or dtype
    differs replaced by an empty one of the saved shape and dtype, so that a state whose tensors
    change size (a history, a buffer of pending samples) loads what was saved. ``saved``: the
    checkpoint's ``state_dict_metadata``; ``limit``: the bytes the checkpoint's files hold, which
    no saved tensor can exceed."""
    if isinstance(value, dict):
        fitted = value.copy()  # of the same class (an OrderedDict, a Counter)
        for k, v in value.items():
            fitted[k] = fit_to_saved(v, f"{fqn}.{k}", saved, limit)
        return fitted
    if isinstance(value, list):
        return [fit_to_saved(v, f"{fqn}.{i}", saved, limit) for i, v in enumerate(value)]
    if not torch.is_tensor(value) or isinstance(value, DTensor):
        return value
    md = saved.get(fqn)
    size, props = getattr(md, "size", None), getattr(md, "properties", None)
    dtype = getattr(props, "dtype", None)
    if size is None or not isinstance(dtype, torch.dtype):
        return value  # not saved as a tensor: DCP reports what is missing
    if tuple(size) == tuple(value.shape) and dtype == value.dtype:
        return value
    nbytes = dtype.itemsize * int(np.prod([int(s) for s in size], dtype=np.int64))
    if min((int(s) for s in size), default=0) < 0 or (limit is not None and nbytes > limit):
        raise CheckpointError(
            f"the checkpoint's entry {fqn} claims a {dtype} tensor of shape {list(size)} "
            f"({nbytes} bytes), more than its files hold: the checkpoint is corrupt"
        )
    return torch.empty(tuple(int(s) for s in size), dtype=dtype)
