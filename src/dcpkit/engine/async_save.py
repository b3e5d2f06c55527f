"""Asynchronous saves: training stalls only for a memory copy.

Protocol, in the order the manager calls it:

1. ``save(state, info)`` waits for the previous save to be durable (raising its error, if any),
   then starts copying every tensor of ``state`` into staging buffers that are allocated once,
   for the state's shapes, and reused by every later save: shared memory on CPU, page-locked
   (pinned) shared memory on CUDA for ``async_with_pinned_mem``, filled by non-blocking copies on
   a side stream. Non-tensor values are copied at this moment.
2. ``wait_for_staging()`` (just before ``optimizer.step()``) returns once the copy is done: the
   only time training is blocked.
3. A background writer writes the buffers through ``torch.distributed.checkpoint`` and publishes
   the step with the same atomic rule as a synchronous save: a thread for ``async``, a persistent
   process per rank for ``async_with_pinned_mem``. Its collectives run on a process group of
   their own.
4. ``wait()`` blocks until the last save is durable; ``close()`` drains and stops the writer.

Old steps that retention drops are handed to ``retire`` (the manager's background deleter)
instead of being deleted by the writer: under backpressure the next save waits for the write
only, not for the deletion.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor

from dcpkit import dist
from dcpkit.engine import chunk_layout, planning
from dcpkit.engine.plan_seed import Seed
from dcpkit.engine.publish import StepInfo, write_and_publish
from dcpkit.engine.staged import StagedPlanner, StagedStep
from dcpkit.engine.writer_process import WriterProcess
from dcpkit.errors import CheckpointError
from dcpkit.units import human_bytes

logger = logging.getLogger(__name__)
_IMMUTABLE = (int, float, bool, str, bytes, type(None))


class AsyncSaveError(CheckpointError):
    """A background save failed; raised in the training process, naming the step (a
    ``CheckpointError``, as a synchronous save's failure is)."""


class AsyncCheckpointer:
    """Staging buffers plus a background writer (a thread, or a persistent process)."""

    def __init__(
        self, mode: str, retire: Callable[[Any, list[int]], None], plan_key: str = ""
    ) -> None:
        self.mode = mode
        self.retire = retire
        self.plan_key = plan_key
        self.use_process = mode == "async_with_pinned_mem"
        # Page-locked buffers only when there is a device to copy from (decided per buffer).
        self.pin = self.use_process and torch.cuda.is_available()
        self._pin_failed = False
        self.buffers: dict[str, torch.Tensor] = {}
        self._item_cache: dict[Any, list[WriteItem]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpkit-writer")
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._pending_store: Any = None
        self._staged = threading.Event()
        self._staged.set()
        self._copy_error: BaseException | None = None
        self._stream: Any = None
        self._copy_event: Any = None
        self.group = None
        self._child: WriterProcess | None = None
        if self.use_process:
            self._child = WriterProcess()
        elif dist.is_dist():
            # Collectives of the writer thread must never interleave with training's.
            self.group = torch_dist.new_group(backend="gloo")

    # -- the manager's calls

    def save(self, state: dict[str, Any], info: StepInfo, seed: Seed | None = None) -> None:
        """Start an asynchronous save of ``state``; returns once the copy has been started.
        ``seed``: the checkpoint a restart resumed from, whose plans its first save takes."""
        self.wait()
        flat, mappings = flatten_state_dict(state)
        items: list[WriteItem] = []
        objects: dict[str, bytes] = {}
        sources: dict[str, torch.Tensor] = {}
        layouts: dict[str, Any] = {}
        with torch.no_grad():  # to_local() without autograd's bookkeeping
            for fqn, obj in flat.items():
                if isinstance(obj, DTensor):
                    if obj.device_mesh.get_coordinate() is None:
                        continue
                    sources[fqn] = obj.to_local()
                    layouts[fqn] = chunk_layout.layout_of(obj)
                elif torch.is_tensor(obj):
                    sources[fqn] = obj
                elif type(obj) in _IMMUTABLE:
                    objects[fqn] = obj
                else:
                    # Small values, serialized by the writer; copied now: they may change.
                    objects[fqn] = copy.deepcopy(obj)
                items.extend(self._write_items(fqn, obj))
        new_buffers = self._ensure_buffers(sources)
        staged = StagedStep(info, items, mappings, objects, self.plan_key, seed, layouts)
        self._staged.clear()
        self._copy_error = None
        on_device = any(src.is_cuda for src in sources.values())
        if on_device:
            self._copy_on_side_stream(sources)
        self._pending_step, self._pending_store = info.step, info.store
        self._pending = self._executor.submit(self._run, staged, sources, new_buffers, on_device)

    def wait_for_staging(self) -> None:
        """Block until the copy is done (the state may be modified afterwards)."""
        if self._copy_event is not None:
            self._copy_event.synchronize()
            self._copy_event = None
        self._staged.wait()
        if self._copy_error is not None:
            err, self._copy_error = self._copy_error, None
            raise AsyncSaveError(
                f"staging the save of step {self._pending_step} failed: {err}"
            ) from err
        if self._pending is not None and self._pending.done() and self._pending.exception():
            self.wait()  # the background write already failed: say so now, not a save later

    def wait(self) -> None:
        """Block until the last save is durable; raise its error, naming the step."""
        if self._pending is None:
            return
        pending, step, store = self._pending, self._pending_step, self._pending_store
        self._pending = None
        try:
            pending.result()
        except BaseException as e:
            tail = ""
            if not ("still the latest" in str(e) or "is published" in str(e)):
                try:  # the store that failed the save may not answer a listing either
                    latest = store.latest_step() if store is not None else None
                    where = f"step {latest} is still the latest" if latest is not None else (
                        "none is published"
                    )  # fmt: skip
                except Exception as listing:
                    where = f"its folder could not be listed: {listing}"
                tail = f"; step {step} was not written ({where})"
            raise AsyncSaveError(f"the asynchronous save of step {step} failed: {e}{tail}") from e

    def global_plans(self) -> int:
        """DCP global plannings run by this rank's writer (its process, for the process mode)."""
        if self._child is not None:
            return self._child.plans
        return planning.global_plans(self.plan_key)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            if self._child is not None:
                self._child.stop()
                self._child = None
            for buf in self.buffers.values():
                _unpin(buf)
            self.buffers.clear()

    # -- internals

    def _write_items(self, fqn: str, obj: Any) -> list[WriteItem]:
        """DCP's write items for one entry; they depend on shape, dtype and sharding only, so
        they are computed once and reused by every later save."""
        if isinstance(obj, DTensor):
            key: Any = (
                fqn,
                "d",
                tuple(obj.shape),
                obj.dtype,
                tuple(obj.placements),
                id(obj.device_mesh),
            )
        elif torch.is_tensor(obj):
            key = (fqn, "t", tuple(obj.shape), obj.dtype)
        else:
            key = (fqn, "o")
        items = self._item_cache.get(key)
        if items is None:
            items = self._item_cache[key] = _create_write_items(fqn, obj)
        return items

    def _ensure_buffers(self, sources: dict[str, torch.Tensor]) -> bool:
        """Allocate buffers for new or changed shapes only; True if any changed."""
        stale = {}
        for fqn, src in sources.items():
            buf = self.buffers.get(fqn)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                stale[fqn] = src
        if stale and self.use_process:
            self._check_shared_memory(sum(t.numel() * t.element_size() for t in stale.values()))
        for fqn, src in stale.items():
            if fqn in self.buffers:
                _unpin(self.buffers[fqn])  # no save is in flight (save() waited): unused
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            if self.use_process:
                buf.share_memory_()
            if self.pin and src.is_cuda and buf.numel() and not self._pin_failed:
                self._pin_failed = not _pin(buf)
            self.buffers[fqn] = buf
        removed = set(self.buffers) - set(sources)
        for fqn in removed:
            _unpin(self.buffers.pop(fqn))
        if stale:
            total = sum(b.numel() * b.element_size() for b in self.buffers.values())
            kind = "shared memory" if self.use_process else "memory"
            if any(b.data_ptr() in _PINNED for b in self.buffers.values()):
                kind = "page-locked shared memory"
            logger.info(
                "checkpoint: %s of staging buffers in %s on this rank (allocated once, reused "
                "by every later save)",
                human_bytes(total),
                kind,
            )
        return bool(stale or removed)

    def _check_shared_memory(self, nbytes: int) -> None:
        """Shared buffers live in /dev/shm; one that does not fit would crash the process with
        SIGBUS at first touch (a container's default /dev/shm is 64 MiB). Refuse, explaining."""
        free = _shm_free()
        if free is not None and nbytes > free:
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            share = f" (shared by the {ranks} ranks of this node)" if ranks > 1 else ""
            raise AsyncSaveError(
                f"async_with_pinned_mem needs {human_bytes(nbytes)} of shared memory for this "
                f"rank's staging buffers, and {SHM_DIR}{share} has {human_bytes(free)} free; "
                'enlarge it (e.g. docker run --shm-size=...), or use async_mode = "async" '
                "(process-private buffers and a writer thread)"
            )

    def _copy_on_side_stream(self, sources: dict[str, torch.Tensor]) -> None:
        """Enqueue the device-to-host copies on a side stream, after the work already queued on
        the current stream; the training thread goes on at once."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for fqn, src in sources.items():
                # A temporary of the state dict must not be reused before the copy has read it.
                if src.is_cuda:
                    src.record_stream(self._stream)
                self.buffers[fqn].copy_(src, non_blocking=src.is_cuda)
            self._copy_event = torch.cuda.Event()
            self._copy_event.record(self._stream)

    def _run(
        self,
        staged: StagedStep,
        sources: dict[str, torch.Tensor],
        new_buffers: bool,
        on_device: bool,
    ) -> None:
        try:
            if on_device:
                # Already enqueued on the side stream; wait for it here, off the training thread.
                self._stream.synchronize()
            else:
                for fqn, src in sources.items():
                    self.buffers[fqn].copy_(src)
        except BaseException as e:
            self._copy_error = e
            raise
        finally:
            self._staged.set()
        if self._child is not None:
            if new_buffers:  # shared once; every later save reuses them
                self._child.send_buffers(self.buffers)
            doomed = self._child.write(staged)
        else:
            doomed = write_and_publish(
                staged.info,
                {},
                planner=StagedPlanner(staged, self.buffers, self.group),
                group=self.group,
                delete_now=False,
            ).doomed
        if doomed:
            self.retire(staged.info.store, doomed)


SHM_DIR = "/dev/shm"


def _shm_free() -> int | None:
    """Free bytes in the shared-memory file system, None where there is none to ask."""
    try:
        return shutil.disk_usage(SHM_DIR).free
    except OSError:
        return None


_PINNED: set[int] = set()  # data pointers this process registered with the CUDA driver
_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process


def _cuda_status(ret: Any) -> int:
    return int(ret[0] if isinstance(ret, tuple) else ret)


def _pin(buf: torch.Tensor) -> bool:
    """Page-lock a shared-memory buffer in place, so that device-to-host copies go straight into
    it by DMA. The driver can refuse (``ulimit -l``, a container's locked-memory limit): the save
    is then still correct, only its copies are slower; say so once and go on."""
    ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
    try:
        err = _cuda_status(
            torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE)
        )
    except Exception as e:  # no CUDA runtime binding in this build
        err, detail = -1, str(e)
    else:
        detail = f"CUDA error {err}"
    if err != 0:
        logger.warning(
            "async_with_pinned_mem: could not page-lock %.1f MiB of staging memory (%s); "
            "saves stay correct, their device-to-host copies are slower. Raise the "
            "locked-memory limit (ulimit -l) to pin.",
            nbytes / (1 << 20),
            detail,
        )
        return False
    _PINNED.add(ptr)
    return True


def _unpin(buf: torch.Tensor) -> None:
    """Undo ``_pin`` before the memory is freed: registered pages that are freed make a later
    registration of the same addresses fail."""
    ptr = buf.data_ptr()
    if ptr in _PINNED:
        _PINNED.discard(ptr)
        torch.cuda.cudart().cudaHostUnregister(ptr)
