"""DTensor layouts and the chunks they give, computed by every rank alike (``described``).

A DTensor's chunk at each mesh coordinate is a nest of ``torch.chunk`` splits: per tensor dim,
the mesh dims whose ``Shard`` placement splits it, outermost first (FSDP's ``_StridedShard``
under TP splits inside the TP piece). A ``Replicate`` mesh dim leaves the chunk the same. A
submesh (FSDP's dp mesh beside TP) has one copy per coordinate of the other dims; its ranks are
``base + coordinate . strides``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor, Replicate, Shard

try:
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - an older torch
    _StridedShard = None  # type: ignore[assignment,misc]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a DTensor's chunks lie: picklable, small (an async save's writer gets it)."""

    mesh: tuple[int, ...]
    """The mesh's shape."""
    base: int
    """The mesh's first rank: a submesh (FSDP's over TP) has one copy per other coordinate."""
    strides: tuple[int, ...]
    """The ranks' step along each mesh dim: its ranks are ``base + coordinate . strides``."""
    coordinate: tuple[int, ...]
    """This rank's place in the mesh."""
    splits: tuple[tuple[int, ...], ...]
    """Per tensor dim, the mesh dims that split it, outermost first."""
    replicated: tuple[int, ...]
    """The mesh dims over which the chunk stays the same."""


_meshes: dict[int, tuple[Any, Any]] = {}  # id(mesh) -> (mesh, (base, strides) or None), kept alive


def _affine(ranks: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """(base, strides) when ``ranks[c] == base + c . strides`` for every coordinate ``c``."""
    base = int(ranks.flatten()[0])
    strides, expected = [], torch.full(ranks.shape, base, dtype=torch.int64)
    for d, n in enumerate(ranks.shape):
        unit = [0] * ranks.dim()
        unit[d] = 1 if n > 1 else 0
        stride = int(ranks[tuple(unit)]) - base
        strides.append(stride)
        shape = [1] * ranks.dim()
        shape[d] = n
        expected = expected + torch.arange(n).view(shape) * stride
    return (base, tuple(strides)) if torch.equal(expected, ranks.to(torch.int64)) else None


def _members(base: int, mesh: tuple[int, ...], strides: tuple[int, ...]) -> frozenset[int]:
    out = {base}
    for n, stride in zip(mesh, strides):
        out = {r + i * stride for r in out for i in range(n)}
    return frozenset(out)


_member_sets: dict[tuple, frozenset[int]] = {}  # type: ignore[type-arg]


def layout_of(t: DTensor) -> Layout | None:
    """The layout of ``t``; None where it cannot be described (a ``Partial`` placement, a rank
    outside the mesh)."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    held = _meshes.get(id(mesh))
    if held is None or held[0] is not mesh:
        held = _meshes[id(mesh)] = (mesh, _affine(mesh.mesh))
    if held[1] is None:
        return None
    splits: list[list[int]] = [[] for _ in t.shape]
    strided, replicated = [], []
    for m, p in enumerate(t.placements):
        if _StridedShard is not None and isinstance(p, _StridedShard):
            strided.append((m, p.dim % t.ndim))  # split inside the later mesh dims' pieces
        elif isinstance(p, Shard):
            splits[p.dim % t.ndim].append(m)
        elif isinstance(p, Replicate):
            replicated.append(m)
        else:
            return None
    for m, d in reversed(strided):
        splits[d].append(m)
    return Layout(
        tuple(mesh.shape),
        *held[1],
        tuple(coordinate),
        tuple(tuple(s) for s in splits),
        tuple(replicated),
    )


def layouts_of(flat: dict[str, Any]) -> dict[str, Layout | None]:
    """Every DTensor's layout in a flattened state dict."""
    return {k: layout_of(v) for k, v in flat.items() if isinstance(v, DTensor)}


def _pieces(n: int, layout: Layout, dims: tuple[int, ...], keep_empty: bool) -> list:  # type: ignore[type-arg]
    """A tensor dim of ``n`` split by ``dims`` (outermost first), torch.chunk's way: each piece
    ``(offset, size, coordinates)``."""
    return _split(n, layout.mesh, dims, keep_empty)


@functools.lru_cache(maxsize=4096)
def _split(n: int, mesh: tuple[int, ...], dims: tuple[int, ...], keep_empty: bool) -> list:  # type: ignore[type-arg]
    out: list[tuple[int, int, tuple[int, ...]]] = [(0, n, ())]
    for m in dims:
        k = mesh[m]
        nxt = []
        for off, size, coords in out:
            step = -(-size // k)
            for i in range(k):
                start = min(step * i, size)
                piece = max(0, min(size, start + step) - start)
                if piece or keep_empty:
                    nxt.append((off + start, piece, (*coords, i)))
        out = nxt
    return out


def chunk_at(size: tuple[int, ...], layout: Layout, coordinate: tuple[int, ...]) -> tuple:  # type: ignore[type-arg]
    """The (offsets, sizes) of the chunk at ``coordinate``."""
    offsets, sizes = [], []
    for d, n in enumerate(size):
        off, piece = 0, n
        for m in layout.splits[d]:
            step = -(-piece // layout.mesh[m])
            start = min(step * coordinate[m], piece)
            off, piece = off + start, max(0, min(piece, start + step) - start)
        offsets.append(off)
        sizes.append(piece)
    return tuple(offsets), tuple(sizes)


def chunks(size: tuple[int, ...], layout: Layout) -> list[ChunkStorageMetadata]:
    """Every chunk with data (one zero-size chunk for a tensor without elements)."""
    offsets, sizes = specs(size, layout)
    return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in zip(offsets, sizes)]


def specs(size: tuple[int, ...], layout: Layout) -> tuple[list[tuple[int, ...]], list[Any]]:
    """The offsets and the sizes of every chunk ``chunks`` lists, in its order."""
    if math.prod(size) == 0:
        offsets, sizes = chunk_at(size, layout, (0,) * len(layout.mesh))
        return [offsets], [sizes]
    return _specs(tuple(size), layout.mesh, layout.splits)


@functools.lru_cache(maxsize=1024)
def _specs(size: tuple[int, ...], mesh: tuple[int, ...], splits: Any) -> tuple[list, list]:  # type: ignore[type-arg]
    per_dim = [_split(n, mesh, splits[d], False) for d, n in enumerate(size)]
    combos = list(itertools.product(*per_dim))
    return [tuple(p[0] for p in c) for c in combos], [tuple(p[1] for p in c) for c in combos]


def _linear(coordinate: tuple[int, ...], mesh: tuple[int, ...], dims: Any) -> int:
    index = 0
    for m in dims:
        index = index * mesh[m] + coordinate[m]
    return index


def writes(layout: Layout, size: tuple[int, ...], key_number: int, world: int) -> bool:
    """Whether this rank writes its chunk: one replica per chunk, chosen by key and chunk; a
    zero-size chunk by none (one, the first, for a tensor without elements). A submesh's
    copies (one per coordinate of the other mesh dims) leave it to the copy holding the rank
    ``key_number % world``."""
    key = (layout.base, layout.mesh, layout.strides)
    members = _member_sets.get(key)
    if members is None:
        members = _member_sets[key] = _members(*key)
    if len(members) < world and key_number % world not in members:
        return False
    _, sizes = chunk_at(size, layout, layout.coordinate)
    sharded = [m for m in range(len(layout.mesh)) if m not in layout.replicated]
    shard = _linear(layout.coordinate, layout.mesh, sharded)
    if math.prod(size) == 0:
        if shard != 0:
            return False
    elif 0 in sizes:
        return False
    replicas = math.prod(layout.mesh[m] for m in layout.replicated)
    replica = _linear(layout.coordinate, layout.mesh, layout.replicated)
    return replica == (key_number + shard) % replicas


_positions: dict[tuple, dict[int, int]] = {}  # type: ignore[type-arg]


def chunk_number(size: tuple[int, ...], layout: Layout, offsets: tuple[int, ...]) -> int:
    """The place of the chunk at ``offsets`` in ``chunks(size, layout)``."""
    if math.prod(size) == 0:
        return 0
    number = 0
    for d, n in enumerate(size):
        key = (n, layout.mesh, layout.splits[d])
        where = _positions.get(key)
        if where is None:
            pieces = _pieces(n, layout, layout.splits[d], False)
            where = _positions[key] = {p[0]: i for i, p in enumerate(pieces)}
        number = number * len(where) + where[offsets[d]]
    return number


def pieces(n: int, layout: Layout, dims: tuple[int, ...]) -> list[tuple[int, int]]:
    """The pieces with data of a tensor dim of ``n`` split by ``dims``: (offset, size), in the
    order ``chunks`` lists them."""
    return [(off, size) for off, size, _ in _pieces(n, layout, dims, False)]
