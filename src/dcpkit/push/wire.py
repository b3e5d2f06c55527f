"""What crosses between a trainer and an inference engine's workers in a weight push: a gloo
group of its own (the trainer is rank 0; the engine's workers follow), and buckets of tensors
packed into one byte buffer each, broadcast by the trainer. Torch only: both sides import it,
and the engine's side needs nothing else of dcpkit's."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "dcpkit_gloo"
"""The name dcpkit's transport is registered under in vLLM (``--weight-transfer-config``)."""


@dataclass(frozen=True)
class Entry:
    """One tensor of a bucket: its name on the engine, dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize


def dtype_of(name: str) -> torch.dtype:
    """A dtype from its name (``float32``), refused unless it is one."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} names no torch dtype")
    return dtype


def serve_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The trainer's rendezvous store, on a free port of ``host`` (``.port`` tells which)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, 0, None, True, timeout=timeout, wait_for_workers=False)


def open_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    session: str,
    timeout_s: float,
    store: dist.Store | None = None,
) -> dist.ProcessGroup:
    """The push's gloo group (rank 0, the trainer, serves the store: ``serve_store``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, None, False, timeout=timeout)
    prefixed = dist.PrefixStore(f"dcpkit-push/{session}", store)
    return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)


def broadcast(group: dist.ProcessGroup, buffer: torch.Tensor) -> Any:
    """``buffer`` from rank 0 to every rank of ``group`` (received in place elsewhere),
    started: the returned work's ``wait()`` ends it."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return group.broadcast([buffer], opts)


def pack(
    tensors: list[tuple[str, torch.Tensor]], into: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[Entry]]:
    """One contiguous byte buffer holding ``tensors`` end to end, and what it holds: the
    start of ``into`` when it is large enough (memory kept from one bucket to the next is
    not faulted in again, which costs more than the copy); one tensor larger than that, its
    own bytes (no copy)."""
    entries = [Entry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in tensors]
    total = sum(e.nbytes for e in entries)
    fits = into is not None and into.numel() >= total
    if not fits and len(tensors) == 1 and tensors[0][1].is_contiguous():
        return tensors[0][1].detach().reshape(-1).view(torch.uint8), entries  # sent as it is
    buffer = into[:total] if fits else torch.empty(total, dtype=torch.uint8)
    at = 0
    for (_, t), e in zip(tensors, entries, strict=True):
        buffer[at : at + e.nbytes].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        at += e.nbytes
    return buffer, entries


def unpack(buffer: torch.Tensor, entries: list[Entry]) -> list[tuple[str, torch.Tensor]]:
    """The tensors ``pack`` put in ``buffer`` (views of it), checked against its size."""
    need = sum(e.nbytes for e in entries)
    if need != buffer.numel():
        raise ValueError(f"a bucket of {buffer.numel()} bytes cannot hold {need} bytes of tensors")
    out, at = [], 0
    for e in entries:
        t = buffer[at : at + e.nbytes].view(dtype_of(e.dtype)).reshape(e.shape)
        out.append((e.name, t))
        at += e.nbytes
    return out


def entries_from(info: dict) -> list[Entry]:
    """A bucket's entries from its update message (names, dtype names, shapes)."""
    names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError("a weight update's names, dtype_names and shapes differ in length")
    return [Entry(str(n), str(d), tuple(map(int, s))) for n, d, s in zip(names, dtypes, shapes)]


def message(entries: list[Entry], bucket: int, version: str) -> dict:
    """The update message that announces one bucket to the engine."""
    return {
        "names": [e.name for e in entries],
        "dtype_names": [e.dtype for e in entries],
        "shapes": [list(e.shape) for e in entries],
        "nbytes": sum(e.nbytes for e in entries),
        "bucket": bucket,
        "version": version,
    }
