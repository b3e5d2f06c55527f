"""Small helpers over ``torch.distributed`` that also work without a process group, and over
the process itself (threads for IO, the garbage collector, torch.save's CRC-32)."""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


def io_threads() -> int:
    """Threads a rank reads or writes checkpoint files with: one per core, at most 8 (the
    writes overlap torch's serialization of one file with the disk writing another)."""
    return max(1, min(8, os.cpu_count() or 1))


_group_seen = False
_alone = threading.local()


@contextlib.contextmanager
def this_process_only() -> Iterator[None]:
    """In this thread, work as if no process group existed: no collective runs and this
    process is rank 0 of 1. For what one process of a group does on its own (a framework that
    saves a replicated checkpoint from its rank 0 only, the others not taking part)."""
    before = getattr(_alone, "on", False)
    _alone.on = True
    try:
        yield
    finally:
        _alone.on = before


def is_dist() -> bool:
    global _group_seen
    if getattr(_alone, "on", False):
        return False
    if dist.is_available() and dist.is_initialized():
        _group_seen = True
        return True
    return False


def settle() -> None:
    """Give gloo's worker threads the GIL for a moment, after a group's last collective.

    A gloo worker thread releases a finished collective's tensors after the caller has been
    told it is done, and releasing a tensor Python also refers to takes the GIL. Two ends of a
    program then go wrong, rarely. A process that exits within a few milliseconds of its last
    collective (``all_gather_object``, or the one a DCP save or load ends with) can reach
    interpreter finalization first: the worker thread, asking for the GIL then, is ended
    mid-C++ and the process aborts with "terminate called without an active exception"
    (SIGABRT) after all its work is done. And the group outlives ``destroy_process_group``
    while modules refer to it (a DDP model's reducer, FSDP's meshes): when the last of them is
    freed, the group's destructor joins its threads while holding the GIL, and a thread still
    waiting for the GIL deadlocks the process. Sleeping here lets them finish first. Called at
    exit, and before ``destroy_process_group`` by dcpkit's trainer; a script that destroys
    its group while its model lives calls it the same way."""
    if _group_seen:
        time.sleep(0.05)


atexit.register(settle)


def rank() -> int:
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def barrier(group: Any = None) -> None:
    if is_dist():
        dist.barrier(group=group)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    if not is_dist():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_sum(values: list[int], group: Any = None) -> list[int]:
    """``values`` summed over the ranks of ``group`` (one all-reduce of a few integers)."""
    return _all_reduce(values, group, dist.ReduceOp.SUM if is_dist() else None)


def all_min(values: list[int], group: Any = None) -> list[int]:
    """The least of each of ``values`` over the ranks of ``group`` (the greatest of ``v`` is
    ``-min(-v)``)."""
    return _all_reduce(values, group, dist.ReduceOp.MIN if is_dist() else None)


def _all_reduce(values: list[int], group: Any, op: Any) -> list[int]:
    if not is_dist():
        return list(values)
    backend = str(dist.get_backend(group))
    cpu = "gloo" in backend or "mpi" in backend
    box = torch.tensor(values, dtype=torch.int64, device="cpu" if cpu else "cuda")
    dist.all_reduce(box, op=op, group=group)
    return [int(v) for v in box.tolist()]


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    if not is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def first_rank_error(fn: Any, errors: tuple[type[BaseException], ...]) -> str | None:
    """Run ``fn`` on rank 0 only; every rank returns the message of the ``errors`` it raised
    (None when it succeeded), so that all ranks can fail together. Any other exception is
    raised on every rank (rank 0's own; a ``RuntimeError`` naming it on the others): never
    rank 0 alone while the others wait for it."""
    error, other, raised = None, None, None
    if rank() == 0:
        try:
            fn()
        except errors as e:
            error = str(e)
        except Exception as e:
            raised, other = e, f"{type(e).__name__}: {e}"
    error, other = broadcast_object((error, other))
    if raised is not None:
        raise raised
    if other is not None:
        raise RuntimeError(f"rank 0 failed: {other}")
    return error


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """DCP warns on every call made without a process group ("assuming the intent is to save
    in a single process"); where that is the intent, say nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off for a block (as it was before, after): a save or a load
    allocates many objects with no cycles, and each full collection would walk the whole heap."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_crc_lock = threading.Lock()
_crc_users = 0
_crc_before = True


@contextlib.contextmanager
def records_without_crc32(fs: Any = None) -> Iterator[None]:
    """``torch.save`` without a CRC-32 of every record while a checkpoint's data is written.

    DCP writes each tensor with ``torch.save``, whose CRC-32 doubles its CPU cost (1 GiB into
    the page cache: 0.44 s with it, 0.20 s without, as long as a raw write); dcpkit's per-file
    xxh3 checksums cover the same bytes, and ``torch.load`` (so DCP's own reader) does not
    check it. Overlapping saves share one window (counted), and the setting found before the
    first is restored after the last. A ``torch.save`` made by another thread inside the window
    also has no CRC-32 where torch's switch is process-wide; ``torch.load`` reads it the same.

    Torch 2.13 keeps the switch per thread, and DCP's writer serializes from threads of its
    own: with ``fs``, the writer's file system, each stream it opens turns the CRC-32 off in
    the thread that uses it (and back, after)."""
    global _crc_users, _crc_before
    get = getattr(torch.serialization, "get_crc32_options", None)
    set_ = getattr(torch.serialization, "set_crc32_options", None)
    if get is None or set_ is None:
        yield
        return
    with _crc_lock:
        if _crc_users == 0:
            _crc_before = get()
            set_(False)
        _crc_users += 1
    shadowed = fs is not None and "create_stream" in vars(fs)
    if fs is not None:
        create = fs.create_stream

        @contextlib.contextmanager
        def create_stream(path: Any, mode: str) -> Iterator[Any]:
            before = get()
            set_(False)
            try:
                with create(path, mode) as stream:
                    yield stream
            finally:
                set_(before)

        fs.create_stream = create_stream
    try:
        yield
    finally:
        if fs is not None:
            if shadowed:
                fs.create_stream = create
            else:
                del fs.create_stream
        with _crc_lock:
            _crc_users -= 1
            if _crc_users == 0:
                set_(_crc_before)
