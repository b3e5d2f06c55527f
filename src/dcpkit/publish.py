"""Writing one checkpoint step and publishing it atomically: the path every save takes
(synchronous, background thread, or background process).

Order: rank 0 prepares ``.tmp-step-N`` -> DCP writes every rank's data and ``.metadata`` ->
every rank checksums its own files -> rank 0 writes the manifest -> ``step-N`` by one rename ->
retention. Collectives run on ``group`` (a background writer uses its own group, so that they
never interleave with training's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcpkit import dist, failpoints, layout
from dcpkit.integrity import build_manifest, describe_files, rank_files, write_manifest

logger = logging.getLogger(__name__)


class StepWriter(FileSystemWriter):
    """DCP's filesystem writer, with a crash point once this rank's data is on disk (before
    rank 0 has written ``.metadata``)."""

    def __init__(self, path: Path, step: int, kill_pid: int | None = None) -> None:
        super().__init__(str(path))
        self._step = step
        self._kill_pid = kill_pid

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        future = super().write_data(plan, planner)
        future.wait()
        failpoints.hit("mid_write", self._step, dist.rank(), self._kill_pid)
        return future


@dataclass
class StepInfo:
    """What the manifest says about a step, besides its files."""

    folder: Path
    step: int
    groups: list[str]
    keep_latest_k: int
    dtype: str | None = None
    mesh: dict[str, Any] | None = None
    source: str | None = None
    url: str | None = None
    """Set for a remote (fsspec) folder: published with a commit marker instead of a rename."""
    storage_options: dict[str, Any] | None = None


def write_and_publish(
    info: StepInfo,
    state: dict[str, Any],
    planner: Any = None,
    group: Any = None,
    kill_pid: int | None = None,
) -> float:
    """Write ``state`` as step ``info.step`` and publish it. Returns the checksum seconds."""
    if info.url is not None:
        from dcpkit.remote import write_and_publish_remote

        return write_and_publish_remote(info, state, planner, group, kill_pid)
    rank = dist.rank()
    world = dist.world_size()
    tmp = layout.temp_dir(info.folder, info.step)
    final = layout.step_dir(info.folder, info.step)
    if rank == 0:
        if tmp.exists():
            layout.clean_leftovers(info.folder)
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier(group)
    dcp.save(
        state,
        storage_writer=StepWriter(tmp, info.step, kill_pid),
        planner=planner,
        process_group=group,
        no_dist=not dist.is_dist(),
    )
    failpoints.hit("after_write", info.step, rank, kill_pid)
    start = time.perf_counter()
    files = describe_files(tmp, rank_files(tmp, rank))
    checksum_s = time.perf_counter() - start
    gathered = dist.all_gather_object(files, group)
    if rank == 0:
        all_files: dict[str, Any] = {}
        for part in gathered:
            all_files.update(part)
        all_files.update(describe_files(tmp, [layout.METADATA]))
        manifest = build_manifest(
            info.step,
            world,
            info.groups,
            all_files,
            dtype=info.dtype,
            mesh=info.mesh,
            source=info.source,
        )
        write_manifest(tmp, manifest)
        failpoints.hit("before_publish", info.step, rank, kill_pid)
        layout.publish(tmp, final)
        failpoints.hit("after_publish", info.step, rank, kill_pid)
        removed = layout.apply_retention(info.folder, info.keep_latest_k)
        if removed:
            logger.info("checkpoint: retention removed step %s", ", ".join(map(str, removed)))
    dist.barrier(group)
    return checksum_s
