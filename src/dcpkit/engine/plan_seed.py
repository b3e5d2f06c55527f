"""A restart's first save, planned by the checkpoint it resumed from.

DCP plans a save by gathering every rank's local plan on the coordinator, which deduplicates
them and builds the checkpoint's metadata; ``engine.planning`` caches that within a process, so
a run plans once, at its first save. A restarted run is a new process: at the same layout its
first save would plan again what the checkpoint it resumed from already says: which chunks
exist, which rank wrote each (the rank in the name of the file holding it), the shapes, dtypes
and state-dict paths (the index of ``.metadata`` records them all).

So a rank checks its own local plan against that index (every item there, at the same chunk,
shape, dtype and path) and takes the items its own files held; one all-reduce of two integers
then tells every rank whether all ranks matched and whether they took every stored entry
exactly once (each entry is in one file, hence taken by at most one rank). When they did, the
ranks' final plans and the coordinator's metadata come from the checkpoint, and the save sends
empty plans: no gather of plans, no global planning (counted by ``planning.global_plans``).
When the layout differs anywhere (another world size, mesh, shape, a new key), the save plans
as usual.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcpkit.formats.dcp_index import DcpIndex
from dcpkit.layout import rank_file_prefix
from dcpkit.safe_pickle import UnsafeCheckpoint

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Seed:
    """The checkpoint a run resumed from, as its first save needs it (picklable, small)."""

    index_path: str
    """Its ``.metadata`` index, a local file (a remote one is downloaded by the load)."""
    world: int
    """The world size that wrote it."""
    step: int


def claim(plan: SavePlan, index: DcpIndex, rank: int) -> list[WriteItem] | None:
    """The items of ``plan`` (this rank's local plan) that the checkpoint stored in this rank's
    own files, when every item of the plan is in the checkpoint as the plan has it (the same
    key, path, shape, dtype and chunk); else None."""
    paths = index.planner_data()
    mine = plan.planner_data if isinstance(plan.planner_data, dict) else {}
    if paths is None or any(paths.get(k) != tuple(v) for k, v in mine.items()):
        return None
    wanted: dict[str, Any] = {}
    empty: set[int] = set()  # items of zero-size chunks (a shard of a tensor smaller than the mesh)
    for i, item in enumerate(plan.items):
        fqn = item.index.fqn
        if fqn not in index.entries:
            return None
        if item.type == WriteItemType.BYTE_IO:
            wanted[fqn] = None
            continue
        chunk = item.tensor_data.chunk  # type: ignore[union-attr]
        entry = index.entries[fqn]
        if math.prod(chunk.sizes) == 0 and math.prod(entry.get("size") or [1]) != 0:
            # an empty shard of a tensor that is not empty holds nothing: a described save lists
            # no such chunk, so the index has none; the tensor itself must match (an index that
            # lists empty chunks has entries no rank takes: the count after the all-reduce
            # says so). An empty tensor's one chunk is stored, and taken as any other.
            if not _same_tensor(item, entry):
                return None
            empty.add(i)
            continue
        wanted.setdefault(fqn, []).append((list(chunk.offsets), list(chunk.sizes)))
    try:
        stored = index.metadata(wanted)
    except UnsafeCheckpoint:
        return None
    prefix = rank_file_prefix(rank)
    taken: list[WriteItem] = []
    for i, item in enumerate(plan.items):
        if i in empty:
            continue
        key = _stored_key(item, stored.state_dict_metadata.get(item.index.fqn))
        info = stored.storage_data.get(key) if key is not None else None
        if info is None:
            return None
        if info.relative_path.startswith(prefix):
            taken.append(item)
    return taken


def _same_tensor(item: WriteItem, entry: dict[str, Any]) -> bool:
    """Whether the index's ``entry`` is the tensor ``item`` writes a chunk of (shape, dtype)."""
    data = item.tensor_data
    return (
        data is not None
        and "b" not in entry
        and entry.get("size") == list(data.size)
        and entry.get("dtype") == data.properties.dtype
    )


def _stored_key(item: WriteItem, md: Any) -> MetadataIndex | None:
    """The storage key of ``item`` when the checkpoint holds it as the item is; else None."""
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        return MetadataIndex(fqn) if isinstance(md, BytesStorageMetadata) else None
    data = item.tensor_data
    if not isinstance(md, TensorStorageMetadata) or data is None:
        return None
    if md.size != data.size or md.properties.dtype != data.properties.dtype:
        return None
    chunk = data.chunk
    if not any(c.offsets == chunk.offsets and c.sizes == chunk.sizes for c in md.chunks):
        return None
    return MetadataIndex(fqn, chunk.offsets)


def global_metadata(index: DcpIndex) -> Metadata:
    """The checkpoint's metadata as the save's coordinator would have planned it: every key,
    every chunk and every path; the storage entries are the new save's to fill."""
    md = index.metadata(storage=False)
    return Metadata(state_dict_metadata=md.state_dict_metadata, planner_data=index.planner_data())


def open_index(seed: Seed) -> DcpIndex | None:
    try:
        return DcpIndex(seed.index_path)
    except Exception as e:  # every rank goes on to the all-reduce that decides
        logger.info("checkpoint: the first save plans (the index of step %d: %s)", seed.step, e)
        return None
