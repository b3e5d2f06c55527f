"""A job's first save planned from what every rank already knows, without gathering plans.

DCP plans a save by gathering every rank's local plan on the coordinator, which deduplicates
them and builds the checkpoint's metadata: at thousands of ranks, gigabytes of plans and minutes
of planning (``benchmarks/planning_scale.py``). Yet a DTensor's chunks follow from its global
shape, its mesh and its placements, which every rank holds: with ``Shard`` and ``Replicate``
placements (and FSDP's ``_StridedShard`` under TP), the chunk at each mesh coordinate is a nest
of ``torch.chunk`` splits, one per mesh dim that shards a tensor dim, outermost first.

So each rank describes its state (key, global shape, dtype, mesh, placements; for other values
key, kind, shape and dtype), checks that the formula gives its own chunk of every DTensor exactly
as DCP's local plan has it, and two all-reduces of a few integers per top-level state (digests,
their least and greatest) tell every rank which top-level states all ranks describe alike.
When every DTensor lies in such a state and every rank's check passed:

- each rank decides alone what it writes: a chunk held by several ranks (``Replicate`` mesh
  dims) is written by one of them, the replica chosen by key and chunk so that replicas share
  the work; a zero-size chunk by none; a plain tensor that every rank holds by the rank a
  greedy by size (the same on every rank) gives it; a small value by rank 0;
- the only plans sent are those of the top-level states whose keys differ between ranks (the
  per-rank RNG, a per-rank reader's position): the coordinator plans those as DCP does;
- the ranks send their write results as rows of integers, and the coordinator lists every
  DTensor's chunks from its layout as it writes ``.metadata``, one tensor at a time
  (``described_write``).

The checkpoint is DCP's format: TorchTitan's loader and ``dcp.load`` read it. Anything else (a
``Partial`` placement, a DTensor on a submesh, a DTensor in a state whose keys differ between
ranks, a chunk the formula does not give) plans as DCP does, on every rank alike; rank 0 says
why. ``DCPKIT_DESCRIBED_PLANS=0`` plans every first save as DCP does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from dcpkit import dist
from dcpkit.engine.chunk_layout import Layout, chunk_at, writes

ENV = "DCPKIT_DESCRIBED_PLANS"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def digest(parts: Any) -> int:
    """A 63-bit digest of ``repr(parts)``: equal on every rank for equal descriptions."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


@dataclasses.dataclass
class Agreed:
    """A save every rank describes alike: what this rank writes and what it sends."""

    owned: list[WriteItem]
    """This rank's share of the state every rank holds alike."""
    sent: SavePlan
    """The items of the top-level states that differ between ranks (planned as DCP does)."""
    dtensors: dict[str, tuple[Any, tuple[int, ...], Layout]]
    """Every DTensor: its properties, global shape and layout (what the coordinator needs)."""
    shared: list[WriteItem]
    """Every other value all ranks hold alike (rank 0 holds them all)."""
    mappings: dict[str, Any]
    """The state-dict paths of the keys described."""
    per_rank: list[str]
    """The top-level states whose keys differ between ranks."""
    order: list[str] = dataclasses.field(default_factory=list)
    """This rank's keys in its plan's order."""


def _entry(item: WriteItem, layout: Layout | None) -> tuple:  # type: ignore[type-arg]
    fqn = item.index.fqn
    if item.type == WriteItemType.BYTE_IO:
        return (fqn, "b")
    data = item.tensor_data
    assert data is not None
    props = repr(data.properties)
    if layout is None:
        return (fqn, "t", tuple(data.size), props)
    lay = (layout.mesh, layout.strides, layout.splits, layout.replicated)
    return (fqn, "d", tuple(data.size), props, lay)


def _whole(item: WriteItem) -> bool:
    """Whether ``item`` is a value or a whole plain tensor."""
    if item.type == WriteItemType.BYTE_IO:
        return True
    data = item.tensor_data
    if item.type != WriteItemType.TENSOR or data is None:
        return False
    return tuple(data.chunk.sizes) == tuple(data.size) and not any(data.chunk.offsets)


def _check(item: WriteItem, layout: Layout) -> bool:
    """Whether the formula gives this rank's chunk as DCP's plan has it."""
    data = item.tensor_data
    if data is None:
        return False
    size = tuple(data.size)
    offsets, sizes = chunk_at(size, layout, layout.coordinate)
    actual = (tuple(data.chunk.offsets), tuple(data.chunk.sizes))
    if math.prod(size) and 0 in sizes:
        return 0 in actual[1]  # not written: its (clamped) offsets do not matter
    return actual == (offsets, sizes)


@dataclasses.dataclass
class Description:
    """What one rank contributes to the all-reduces: digests, not plans."""

    failed: int
    """1 when a DTensor of this rank cannot be described, or the formula misses its chunk."""
    names: list[str]
    """The top-level states, sorted."""
    digests: list[int]
    """Per top-level state, a digest of its keys, kinds, shapes, dtypes and layouts."""
    has_dtensor: list[bool]

    def first(self) -> list[int]:
        """Reduced by least: whether any rank failed, and whether all hold the same states."""
        d = digest(self.names)
        return [-self.failed, d, -d]

    def second(self) -> list[int]:
        """Reduced by least: per state, the least and greatest digest and whether any rank
        holds a DTensor in it."""
        out = []
        for h, dt in zip(self.digests, self.has_dtensor):
            out += [h, -h, -int(dt)]
        return out


def describe(
    plan: SavePlan, layouts: dict[str, Layout | None], mappings: dict[str, Any]
) -> Description:
    """This rank's description of its local plan."""
    groups: dict[str, list[tuple]] = {}  # type: ignore[type-arg]
    has_dtensor: dict[str, bool] = {}
    failed, seen = 0, set()
    for item in plan.items:
        fqn = item.index.fqn
        name = _group(fqn, mappings)
        layout = layouts.get(fqn)
        if fqn in layouts and (layout is None or not _check(item, layout)):
            failed = 1
        elif fqn not in layouts and not _whole(item):
            failed = 1  # a shard without a layout (a ShardedTensor): planned as DCP plans it
        if fqn in seen:
            failed = 1  # one item per key: what a DTensor or a value gives
        seen.add(fqn)
        groups.setdefault(name, []).append(_entry(item, layout))
        has_dtensor[name] = has_dtensor.get(name, False) or fqn in layouts
    names = sorted(groups)
    return Description(
        failed, names, [digest(sorted(groups[n])) for n in names], [has_dtensor[n] for n in names]
    )


def decide(
    plan: SavePlan,
    layouts: dict[str, Layout | None],
    mappings: dict[str, Any],
    mine: Description,
    first: list[int],
    second: list[int] | None,
    rank: int,
    world: int,
) -> tuple[Agreed | None, str]:
    """From the reduced vectors (the same on every rank): this rank's share, or (None, why)."""
    if first[0]:
        return None, "a DTensor the description cannot give (a placement or a chunk) on a rank"
    if first[1] != -first[2] or second is None:
        return None, "the ranks hold different top-level states"
    per_rank = {n for i, n in enumerate(mine.names) if second[3 * i] != -second[3 * i + 1]}
    if any(second[3 * mine.names.index(n) + 2] for n in per_rank):
        return None, "a state with DTensors differs between ranks"
    return _share(plan, layouts, mappings, per_rank, rank, world), ""


def agree(
    plan: SavePlan, layouts: dict[str, Layout | None], mappings: dict[str, Any], group: Any
) -> tuple[Agreed | None, str]:
    """Every rank, collectively (two all-reduces of a few integers per top-level state): this
    rank's share when all ranks describe the save alike, else (None, why) on every rank."""
    mine = describe(plan, layouts, mappings)
    first = dist.all_min(mine.first(), group)
    same = not first[0] and first[1] == -first[2]
    second = dist.all_min(mine.second(), group) if same else None
    return decide(plan, layouts, mappings, mine, first, second, dist.rank(), dist.world_size())


def _group(fqn: str, mappings: dict[str, Any]) -> str:
    path = mappings.get(fqn)
    return str(path[0]) if path else fqn.split(".")[0]


def _share(
    plan: SavePlan,
    layouts: dict[str, Layout | None],
    mappings: dict[str, Any],
    per_rank: set[str],
    rank: int,
    world: int,
) -> Agreed:
    owned: list[WriteItem] = []
    sent: list[WriteItem] = []
    shared: list[WriteItem] = []
    dtensors: dict[str, tuple[Any, tuple[int, ...], Layout]] = {}
    plain: list[WriteItem] = []
    for item in plan.items:
        fqn = item.index.fqn
        if _group(fqn, mappings) in per_rank:
            sent.append(item)
        elif fqn in layouts:
            data = item.tensor_data
            assert data is not None
            dtensors[fqn] = (data.properties, tuple(data.size), layouts[fqn])  # type: ignore[assignment]
        else:
            shared.append(item)
            if item.type == WriteItemType.BYTE_IO:
                if rank == 0:
                    owned.append(item)
            else:
                plain.append(item)
    by_fqn = {item.index.fqn: item for item in plan.items}
    for number, fqn in enumerate(sorted(dtensors)):
        _, size, layout = dtensors[fqn]
        if writes(layout, size, number, world):
            owned.append(by_fqn[fqn])
    loads = [(0, r) for r in range(world)]  # a greedy by size, the same on every rank
    for item in sorted(plain, key=lambda i: (-_nbytes(i), i.index.fqn)):
        load, r = heapq.heappop(loads)
        if r == rank:
            owned.append(item)
        heapq.heappush(loads, (load + _nbytes(item), r))
    sent_fqns = {i.index.fqn for i in sent}
    return Agreed(
        owned=owned,
        sent=SavePlan(sent, planner_data={k: v for k, v in mappings.items() if k in sent_fqns}),
        dtensors=dtensors,
        shared=shared,
        mappings={k: v for k, v in mappings.items() if k not in sent_fqns},
        per_rank=sorted(per_rank),
        order=list(dict.fromkeys(item.index.fqn for item in plan.items)),
    )


def _nbytes(item: WriteItem) -> int:
    data = item.tensor_data
    assert data is not None
    return math.prod(data.size) * data.properties.dtype.itemsize


def shared_entries(agreed: Agreed) -> dict[str, Any]:
    """The coordinator: the metadata of the values all ranks hold alike (from its own plan)."""
    out: dict[str, Any] = {}
    for item in agreed.shared:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            out[fqn] = BytesStorageMetadata()
        else:
            data = item.tensor_data
            assert data is not None
            whole = ChunkStorageMetadata(torch.Size([0] * len(data.size)), data.size)
            out[fqn] = TensorStorageMetadata(data.properties, data.size, [whole])
    return out


def numbered(agreed: Agreed) -> list[tuple[str, Any, tuple[int, ...], Layout]]:
    """Every DTensor as (key, properties, shape, layout), sorted by key: a key's number is its
    place here (``writes``, ``described_write.CompactResults``)."""
    return [(fqn, *agreed.dtensors[fqn]) for fqn in sorted(agreed.dtensors)]
