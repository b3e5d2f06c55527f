"""Memory for the blocks a streaming conversion reads, reused from one block to the next.

A conversion reads a checkpoint a block at a time (at most its budget, 256 MiB by default) and
writes each block before it reads the next. A fresh buffer per block costs the kernel's first
touch of every page: on this project's 2-core machine a read into fresh memory runs at 2.3 GiB/s,
into memory touched before at 16 GiB/s. Inside ``recycled_blocks()``, the format readers take
their buffers from a small pool of this thread, and a buffer is handed out again only once
nothing uses it any more (the memoryview handed out, which a tensor made of it holds, is gone),
so a caller that keeps a block, or several, keeps them intact. Outside, every read gets fresh
memory.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

_state = threading.local()

_KEEP = 3
"""Buffers a pool keeps: a block being written, the next one being read, and one more."""


@dataclass
class _Buffer:
    memory: bytearray
    handed: Any = None
    """A weak reference to the memoryview last handed out: alive while anything (a tensor
    made from it with ``torch.frombuffer``, a view of that tensor) still uses the bytes."""

    def free(self) -> bool:
        return self.handed is None or self.handed() is None


@contextlib.contextmanager
def recycled_blocks() -> Iterator[None]:
    """Reuse block buffers in this thread until the block ends (then they are freed)."""
    outer = getattr(_state, "pool", None)
    _state.pool = []
    try:
        yield
    finally:
        _state.pool = outer


def block(nbytes: int) -> bytearray | memoryview:
    """A writable buffer of ``nbytes`` bytes (contents undefined inside ``recycled_blocks``,
    zeros outside it). Inside, the caller keeps the bytes only through the object returned (or a
    tensor ``torch.frombuffer`` made of it): a slice or copy of the memoryview would not hold
    the buffer."""
    pool: list[_Buffer] | None = getattr(_state, "pool", None)
    if pool is None or nbytes == 0:
        return bytearray(nbytes)
    chosen = next((b for b in pool if len(b.memory) >= nbytes and b.free()), None)
    if chosen is None:
        chosen = _Buffer(bytearray(nbytes))
        pool.append(chosen)
        spare = [b for b in pool if b is not chosen and b.free()]
        while len(pool) > _KEEP and spare:
            smallest = min(spare, key=lambda b: len(b.memory))
            spare.remove(smallest)
            pool.remove(smallest)
    view = memoryview(chosen.memory)[:nbytes]
    chosen.handed = weakref.ref(view)
    return view


def empty(shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor on a ``block`` (recycled inside ``recycled_blocks``)."""
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(block(numel * dtype.itemsize), dtype=dtype).view(shape)
