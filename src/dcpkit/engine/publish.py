"""Writing one checkpoint step and publishing it atomically: the path every save takes
(synchronous, background thread, or background process), on any store.

Order: rank 0 prepares the pending step -> DCP writes every rank's data and ``.metadata`` ->
every rank checksums its own files -> rank 0 writes the manifest and publishes (a rename, or a
commit marker) -> old steps are chosen for deletion, never before the new one is published.
Collectives run on ``group`` (a background writer uses its own group, so that they never
interleave with training's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp

from dcpkit import dist, failpoints
from dcpkit.engine.policy import steps_to_delete
from dcpkit.layout import METADATA, step_name
from dcpkit.manifest import build_manifest

logger = logging.getLogger(__name__)


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
    store = info.store
    pending = store.begin(step_name(info.step), info.step, kill_pid)
    rank = dist.rank()
    if rank == 0:
        pending.prepare()
    dist.barrier(group)
    with dist.quiet_single_process():
        dcp.save(
            state,
            storage_writer=pending.dcp_writer(),
            planner=planner,
            process_group=group,
            no_dist=not dist.is_dist(),
        )
    failpoints.hit("after_write", info.step, rank, kill_pid)
    start = time.perf_counter()
    files = pending.describe(pending.own_files(rank))
    checksum_s = time.perf_counter() - start
    gathered = dist.all_gather_object(files, group)
    doomed: list[int] = []
    if rank == 0:
        all_files: dict[str, Any] = {}
        for part in gathered:
            all_files.update(part)
        all_files.update(pending.describe([METADATA]))
        manifest = build_manifest(
            info.step,
            dist.world_size(),
            info.groups,
            all_files,
            dtype=info.dtype,
            mesh=info.mesh,
            source=info.source,
        )
        pending.write_manifest(manifest)
        pending.publish()
        doomed = steps_to_delete(store.published_steps(), info.keep_latest_k)
        if delete_now:
            delete_steps(store, doomed)
    dist.barrier(group)
    return Published(checksum_s, doomed)


def delete_steps(store: Any, steps: list[int]) -> None:
    for step in steps:
        store.delete(step_name(step))
    if steps:
        logger.info("checkpoint: retention removed step %s", ", ".join(map(str, steps)))
