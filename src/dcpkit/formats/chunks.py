"""Whether a tensor's stored chunks tile it: each inside its bounds, none overlapping another,
together holding every element. Used by every verdict on a DCP checkpoint (``structure``), by
the index of ``.metadata`` as it is read, and by a save's check of its own global plan."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any


def chunk_problems(
    key: str, size: Sequence[int], chunks: Sequence[Any], covered: bool = True, first: bool = False
) -> list[str]:
    """What is wrong with one tensor's stored chunks (each with ``offsets`` and ``sizes``) for a
    tensor of shape ``size``: a chunk out of its bounds, two chunks overlapping, and with
    ``covered`` the chunks not holding every element. ``first``: stop at the first problem.

    Overlaps are found with a sweep line along the dimension with the most distinct chunk
    offsets, so that a grid of chunks (FSDP rows by TP columns) keeps the active set at the
    chunks that share one offset there: about linear in the chunks, where comparing every pair
    was quadratic in the ranks (4096 row shards: 4.2 s per tensor). The comparisons are bounded
    (a checkpoint may be hostile): a layout past ``n * (isqrt(n) + 16) + 2**16`` of them, which
    no grid needs, is a problem of its own."""
    shape, problems = list(size), []
    dims, volume = len(shape), 0
    inside = []
    for c in chunks:
        off, n = list(c.offsets), list(c.sizes)
        if (
            len(off) != dims
            or len(n) != dims
            or any(o < 0 or k < 0 or o + k > s for o, k, s in zip(off, n, shape))
        ):
            problems.append(f"{key}: chunk at {off} of size {n} lies outside the shape {shape}")
            if first:
                return problems
            continue
        elements = math.prod(n)
        volume += elements
        if elements:  # an empty chunk holds nothing to overlap
            inside.append((off, n))
    problems += _overlaps(key, shape, inside, first)
    if first and problems:
        return problems
    total = math.prod(shape)
    if covered and volume != total:
        problems.append(f"{key}: chunks cover {volume} of {total} elements")
    return problems


def _overlaps(
    key: str, shape: list[int], boxes: list[tuple[list[int], list[int]]], first: bool
) -> list[str]:
    if len(boxes) < 2:
        return []
    if not shape:  # two chunks of one scalar
        return [f"{key}: chunks at [] and [] overlap"]
    dims = len(shape)
    sweep = max(range(dims), key=lambda d: (len({o[d] for o, _ in boxes}), shape[d]))
    order = sorted(boxes, key=lambda b: b[0][sweep])
    budget = len(order) * (math.isqrt(len(order)) + 16) + (1 << 16)
    found: list[str] = []
    active: list[tuple[int, int]] = []  # (end along the sweep, index in order)
    for i, (off, n) in enumerate(order):
        while active and active[0][0] <= off[sweep]:
            heapq.heappop(active)
        budget -= len(active)
        if budget < 0:
            return [
                *found,
                f"{key}: its {len(order)} chunks are laid out too irregularly to check for "
                "overlaps (no grid of chunks is)",
            ]
        for _, j in active:
            o2, n2 = order[j]
            if all(off[d] < o2[d] + n2[d] and o2[d] < off[d] + n[d] for d in range(dims)):
                found.append(f"{key}: chunks at {o2} and {off} overlap")
                if first:
                    return found
        heapq.heappush(active, (off[sweep] + n[sweep], i))
    return found
