"""Pieces every conversion shares: model keys of a checkpoint, all-or-nothing output through
the store's publish path, the memory budget, and the progress bar."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from dcpkit.progress import progress
from dcpkit.storage import PendingStep, StoreError, open_location

__all__ = ["DEFAULT_BUDGET", "output", "progress", "row_blocks"]

DEFAULT_BUDGET = 256 << 20
"""Bytes of tensor data a conversion holds at once (a larger tensor is moved in row blocks)."""


def row_blocks(
    shape: tuple[int, ...], itemsize: int, budget: int, granularity: int = 1
) -> list[tuple[int, int] | None]:
    """``[None]`` when the tensor fits the budget, else row ranges of at most ``budget`` bytes
    (a multiple of ``granularity`` rows each)."""
    n = itemsize
    for s in shape:
        n *= s
    if n <= budget or not shape or shape[0] <= granularity:
        return [None]
    row_bytes = n // shape[0]
    step = max(granularity, (budget // row_bytes) // granularity * granularity)
    return [(a, min(a + step, shape[0])) for a in range(0, shape[0], step)]


@contextlib.contextmanager
def output(
    out: str | Path,
    is_dir: bool,
    force: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Iterator[PendingStep]:
    """A pending output for ``out`` (a path or a URL): the block writes into its ``scratch()``
    and publishes it; a failed or interrupted conversion leaves no partial output."""
    store, name = open_location(out, storage_options)
    try:  # an output URL fails as clearly as an input: the URL given, the bucket, the cause
        store.check_reachable()
    except StoreError as e:
        cause = str(e).removeprefix(f"{store.root}: ")
        raise StoreError(f"{out}: {cause}") from None
    existing = store.stat(name)
    if existing is not None and not force and not (existing.is_dir and not store.list_names(name)):
        raise FileExistsError(
            f"{store.location(name)} already exists; choose another path or pass --force to "
            "replace it"
        )
    pending = store.begin(name, is_dir=is_dir)
    pending.prepare()
    try:
        yield pending
    except BaseException:
        pending.abort()
        raise


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if not (a.is_floating_point() or b.is_floating_point()):
        return float((a.long() - b.long()).abs().max())
    return float((a.double() - b.double()).abs().max())
