"""Pieces every conversion shares: model keys of a checkpoint, staged (all-or-nothing) output,
the memory budget, and the progress bar."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from dcpkit.states import DATALOADER, LR_SCHEDULER, OPTIMIZER, RNG, TRAIN_STATE

DEFAULT_BUDGET = 256 << 20
"""Bytes of tensor data a conversion holds at once (a larger tensor is moved in row blocks)."""

NON_MODEL_GROUPS = (OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE, RNG)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}") from None


def is_model_key(key: str) -> bool:
    """A model parameter in TorchTitan's top-level layout (not optimizer, scheduler, ...)."""
    head = key.split(".", 1)[0]
    return head not in NON_MODEL_GROUPS and head not in ("dataloader", "lr_schedulers")


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


def progress(total_bytes: int, desc: str) -> tqdm:
    """A byte progress bar on stderr, shown only on a terminal."""
    return tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=desc,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )


def check_output(out: Path, force: bool) -> None:
    """Refuse to overwrite an existing output unless ``force``."""
    if out.exists() and not force:
        if out.is_dir() and not any(out.iterdir()):
            return
        raise FileExistsError(
            f"{out} already exists; choose another path or pass --force to replace it"
        )


@contextlib.contextmanager
def staged_output(out: Path, is_dir: bool, force: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; it becomes ``out`` only if the block succeeds,
    so a failed or interrupted conversion leaves no partial output."""
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    if is_dir:
        tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()
        raise
    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    os.replace(tmp, out)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if not (a.is_floating_point() or b.is_floating_point()):
        return float((a.long() - b.long()).abs().max())
    return float((a.double() - b.double()).abs().max())
