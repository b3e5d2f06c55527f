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


class _LocalTarget:
    """Publish by rename: write ``.tmp-step-N``, then one rename makes it ``step-N``."""

    def __init__(self, info: StepInfo, kill_pid: int | None) -> None:
        self.info, self.kill_pid = info, kill_pid
        self.tmp = layout.temp_dir(info.folder, info.step)

    def prepare(self) -> None:
        if self.tmp.exists():
            layout.clean_leftovers(self.info.folder)
        self.tmp.mkdir(parents=True, exist_ok=True)

    def writer(self) -> Any:
        return StepWriter(self.tmp, self.info.step, self.kill_pid)

    def describe(self, names: list[str]) -> dict[str, Any]:
        return describe_files(self.tmp, names)

    def own_files(self, rank: int) -> list[str]:
        return rank_files(self.tmp, rank)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        write_manifest(self.tmp, manifest)

    def commit(self) -> None:
        layout.publish(self.tmp, layout.step_dir(self.info.folder, self.info.step))

    def retention(self) -> list[int]:
        return layout.apply_retention(self.info.folder, self.info.keep_latest_k)


def write_and_publish(
    info: StepInfo,
    state: dict[str, Any],
    planner: Any = None,
    group: Any = None,
    kill_pid: int | None = None,
) -> float:
    """Write ``state`` as step ``info.step`` and publish it. Returns the checksum seconds.

    The publish strategy is a rename for local folders and a commit marker for remote ones
    (``info.url``); the order of the steps is the same.
    """
    if info.url is not None:
        from dcpkit.remote import RemoteTarget

        target: Any = RemoteTarget(info)
    else:
        target = _LocalTarget(info, kill_pid)
    rank = dist.rank()
    if rank == 0:
        target.prepare()
    dist.barrier(group)
    with dist.quiet_single_process():
        dcp.save(
            state,
            storage_writer=target.writer(),
            planner=planner,
            process_group=group,
            no_dist=not dist.is_dist(),
        )
    failpoints.hit("after_write", info.step, rank, kill_pid)
    start = time.perf_counter()
    files = target.describe(target.own_files(rank))
    checksum_s = time.perf_counter() - start
    gathered = dist.all_gather_object(files, group)
    if rank == 0:
        all_files: dict[str, Any] = {}
        for part in gathered:
            all_files.update(part)
        all_files.update(target.describe([layout.METADATA]))
        manifest = build_manifest(
            info.step,
            dist.world_size(),
            info.groups,
            all_files,
            dtype=info.dtype,
            mesh=info.mesh,
            source=info.source,
        )
        target.write_manifest(manifest)
        failpoints.hit("before_publish", info.step, rank, kill_pid)
        target.commit()
        failpoints.hit("after_publish", info.step, rank, kill_pid)
        removed = target.retention()
        if removed:
            logger.info("checkpoint: retention removed step %s", ", ".join(map(str, removed)))
    dist.barrier(group)
    return checksum_s
