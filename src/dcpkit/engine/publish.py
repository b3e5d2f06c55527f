"""Writing one checkpoint step and publishing it atomically: the path every save takes
(synchronous, background thread, or background process), on any store.

Order: rank 0 prepares the pending step -> DCP writes every rank's data and ``.metadata`` ->
every rank checksums its own files -> rank 0 writes the manifest and publishes (a rename, or a
commit marker) -> old steps are chosen for deletion, never before the new one is published.
Collectives run on ``group`` (a background writer uses its own group, so that they never
interleave with training's).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcpkit import dist, failpoints
from dcpkit.engine.policy import steps_to_delete
from dcpkit.errors import CheckpointError, disk_full, first_failure, transient
from dcpkit.formats.dcp_index_write import encode_index
from dcpkit.layout import METADATA, METADATA_INDEX, step_name
from dcpkit.manifest import CHECKSUM_ALGORITHM, build_manifest
from dcpkit.storage import StoreError
from dcpkit.storage.holds import delete_unless_held, describe
from dcpkit.units import human_bytes

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class StepInfo:
    """Where a step goes and what its manifest says besides its files (picklable: a writer
    process receives it)."""

    store: Any
    step: int
    groups: list[str]
    keep_latest_k: int
    dtype: str | None = None
    mesh: dict[str, Any] | None = None
    source: str | None = None
    retry_s: float = 0.0
    """How long transient storage errors are retried, with backoff, before the save fails."""
    previous: int | None = None
    """The step saved before this one, to name in a failure when the store cannot be listed."""
    model: dict[str, Any] | None = None
    """The model's family and config.json, recorded in the manifest (see ``build_manifest``)."""
    name: str | None = None
    """The name it is published under; None: ``step-N`` (a framework names its own)."""
    best: int | None = None
    """A step retention keeps beside the newest (the Trainer's best model): ``steps_to_delete``."""
    frozen: dict[str, str] | None = None
    """Frozen entries (parameters that do not train) -> a token of their content: a
    store that can links them from this process's previous save (``storage/frozen.py``)."""


@dataclass
class Published:
    checksum_s: float
    """Seconds this rank spent checksumming its files."""
    doomed: list[int]
    """Steps retention chose to delete (rank 0); deleted already unless deferred."""


def write_and_publish(
    info: StepInfo,
    state: dict[str, Any],
    planner: Any = None,
    group: Any = None,
    kill_pid: int | None = None,
    delete_now: bool = True,
) -> Published:
    """Write ``state`` as step ``info.step`` and publish it.

    ``delete_now=False`` leaves the deletion of the steps retention chose to the caller (a
    background deleter), so that a synchronous save returns as soon as its step is published.
    """
    deadline, delay = time.monotonic() + info.retry_s, 1.0
    while True:
        try:
            return _write_once(info, state, planner, group, kill_pid, delete_now)
        except _Failure as failure:
            if not failure.transient:
                raise CheckpointError(failure.message) from None
            give_up = time.monotonic() + delay > deadline if dist.rank() == 0 else None
            if dist.broadcast_object(give_up, group=group):  # one decision for every rank
                raise CheckpointError(
                    f"{failure.message}; retried for {info.retry_s:.0f}s "
                    "([checkpoint] storage_retry_s): giving up"
                ) from None
            if dist.rank() == 0:
                logger.warning(
                    "checkpoint: step %d: %s; retrying in %.0fs", info.step, failure.message, delay
                )
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


class _Failure(Exception):
    """A failed attempt, the same on every rank: its message and whether to try again."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.message, self.transient = message, transient


def _write_once(
    info: StepInfo,
    state: dict[str, Any],
    planner: Any,
    group: Any,
    kill_pid: int | None,
    delete_now: bool,
) -> Published:
    store = info.store
    pending = store.begin(info.name or step_name(info.step), info.step, kill_pid)
    rank = dist.rank()
    sized = state or getattr(planner, "buffers", {})  # what this rank writes, for messages
    failure = _attempt(lambda: pending.prepare(), info, sized) if rank == 0 else None
    _raise_if(dist.broadcast_object(failure, group=group))
    try:
        writer = pending.dcp_writer()
        if info.frozen and hasattr(writer, "frozen"):
            writer.frozen = info.frozen
        if planner is not None:  # a save planned from the ranks' layout needs the writer's
            planner.streams = getattr(writer, "streams_metadata", False)
        with dist.quiet_single_process():
            dcp.save(
                state,
                storage_writer=writer,
                planner=planner,
                process_group=group,
                no_dist=not dist.is_dist(),
            )
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        if rank == 0:
            with contextlib.suppress(Exception):
                pending.abort()
        cause = first_failure(e)
        raise _Failure(save_failure(cause, info, sized), transient(cause)) from None
    failpoints.hit("after_write", info.step, rank, kill_pid)
    start = time.perf_counter()
    files: dict[str, Any] = {}
    failure = _attempt(lambda: files.update(pending.describe(pending.own_files(rank))), info, sized)
    checksum_s = time.perf_counter() - start
    gathered = dist.all_gather_object((files, failure), group)
    failure = next((f for _, f in gathered if f is not None), None)  # one rank's, for all
    if failure is not None and rank == 0:
        with contextlib.suppress(Exception):
            pending.abort()
    _raise_if(failure)
    doomed: list[int] = []
    if rank == 0:
        all_files: dict[str, Any] = {}
        for part, _ in gathered:
            all_files.update(part)

        def publish() -> None:
            all_files.update(pending.describe([METADATA]))
            index = _index_of(planner, all_files[METADATA])
            if index is not None:
                pending.write_file(METADATA_INDEX, index)
                all_files.update(pending.describe([METADATA_INDEX]))
            manifest = build_manifest(
                info.step,
                dist.world_size(),
                info.groups,
                all_files,
                dtype=info.dtype,
                mesh=info.mesh,
                source=info.source,
                model=info.model,
            )
            pending.write_manifest(manifest)
            pending.publish()

        failure = _attempt(publish, info, sized)
        if failure is not None:
            with contextlib.suppress(Exception):
                pending.abort()
        else:
            doomed = _retention(store, info, delete_now)
    _raise_if(dist.broadcast_object(failure, group=group))
    return Published(checksum_s, doomed)


def _retention(store: Any, info: StepInfo, delete_now: bool) -> list[int]:
    """Rank 0, once step ``info.step`` is published: the steps retention deletes (deleted now
    with ``delete_now``). A store that fails here fails no save: the step is published, and the
    next save's retention deletes them."""
    try:
        doomed = steps_to_delete(store.published_steps(), info.keep_latest_k, info.best)
        if delete_now:
            delete_steps(store, doomed)
    except Exception as e:
        logger.warning(
            "checkpoint: step %d is published, but retention could not %s %s: %s; the next "
            "save's retention tries again", info.step, "delete steps in" if delete_now else
            "list", store.root, e,
        )  # fmt: skip
        return []
    return doomed


def _index_of(planner: Any, written: dict[str, Any]) -> bytes | None:
    """The index of the ``.metadata`` just written (``written``: its size and checksum), from
    the coordinator's planner, which holds it: never parsed back. None when the planner is DCP's
    own (not reachable), or the metadata holds what the index cannot express; loads then read
    ``.metadata`` itself."""
    md = getattr(planner, "metadata", None)
    streamed = getattr(md, "encode_index", None)  # built as the .metadata was written
    if streamed is not None:
        return streamed(written["size"], written[CHECKSUM_ALGORITHM])
    if md is None or not getattr(md, "storage_data", None):
        return None
    try:
        return encode_index(md, written["size"], written[CHECKSUM_ALGORITHM])
    except Exception as e:  # derived data: the checkpoint is whole without it
        logger.warning("checkpoint: no index of %s written (%s); loads read it whole", METADATA, e)
        return None


def _attempt(step: Any, info: StepInfo, state: dict[str, Any]) -> tuple[str, bool] | None:
    """Run ``step``; a storage error becomes the failure every rank raises."""
    try:
        step()
    except Exception as e:
        if not (isinstance(e, OSError | StoreError) or transient(e)):
            raise
        return save_failure(e, info, state), transient(e)
    return None


def _raise_if(failure: tuple[str, bool] | None) -> None:
    if failure is not None:
        raise _Failure(*failure)


def retrying_alone(fn: Callable[[], T], retry_s: float) -> T:
    """``fn()`` in this process alone (no other rank waits on each try), tried again with
    backoff while it fails with a ``transient`` error and ``retry_s`` seconds have not passed."""
    deadline, delay = time.monotonic() + retry_s, 1.0
    while True:
        try:
            return fn()
        except Exception as e:
            if not transient(e) or time.monotonic() + delay > deadline:
                raise
            logger.warning("checkpoint: %s; retrying in %.0fs", e, delay)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


def save_failure(e: BaseException, info: StepInfo, state: dict[str, Any]) -> str:
    """One message for a save that failed: what happened, that the previous step is still the
    latest, and what to do."""
    store = info.store
    try:
        latest = store.latest_step()
    except Exception:  # the store does not answer: the run's own record says
        latest = info.previous
    still = f"Step {latest} is still the latest" if latest is not None else "No step is published"
    where = f"saving step {info.step} into {store.root} failed"
    code = getattr(e, "errno", None)
    space = store.space()
    if disk_full(e, space[0] if space else None):
        need = _state_bytes(state) * dist.world_size()
        have = f" ({human_bytes(space[0])} free of {human_bytes(space[1])})" if space else ""
        return (
            f"{where}: the disk is full{have}; a checkpoint of this run needs about "
            f"{human_bytes(need)}. {still}. Free space or lower keep_latest_k, or point "
            "[checkpoint] folder at a larger disk"
        )
    if code == errno.EACCES or isinstance(e, PermissionError):
        return f"{where}: permission denied ({e}). {still}. Make the folder writable"
    if transient(e):
        endpoint = store.endpoint() or store.root
        return (
            f"{where}: the storage at {endpoint} does not answer ({type(e).__name__}: {e}). {still}"
        )
    if isinstance(e, FileNotFoundError):
        return f"{where}: the folder was removed while the run wrote into it ({e}). {still}"
    return f"{where}: {type(e).__name__}: {e}. {still}"


def _state_bytes(state: Any) -> int:
    if torch.is_tensor(state):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(_state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_state_bytes(v) for v in state)
    return 0


_KEPT_FOR_READERS: set[tuple[str, int]] = set()  # (folder, step) retention left to a reader


def delete_steps(store: Any, steps: list[int]) -> None:
    """Delete ``steps``, except those a reader holds (see ``storage.holds``): each of those is
    kept, and deleted once released, by the last reader to let it go or at a later save. Both
    are logged."""
    removed, released = [], []
    for step in steps:
        holders = delete_unless_held(store, step, store.delete)
        if holders:
            if (store.root, step) not in _KEPT_FOR_READERS:
                logger.info(
                    "checkpoint: retention keeps step %d while %d reader(s) hold it: %s; it is "
                    "deleted once released (by the last reader, or at a later save)",
                    step,
                    len(holders),
                    "; ".join(describe(h) for h in holders),
                )
            _KEPT_FOR_READERS.add((store.root, step))
            continue
        removed.append(step)
        if (store.root, step) in _KEPT_FOR_READERS:
            _KEPT_FOR_READERS.discard((store.root, step))
            released.append(step)
    if removed:
        after = f" ({', '.join(map(str, released))} kept until readers released it)"
        logger.info(
            "checkpoint: retention removed step %s%s",
            ", ".join(map(str, removed)),
            after if released else "",
        )
