"""Checksums of checkpoint files, computed by the rank that wrote them."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import xxhash

CHECKSUM_ALGORITHM = "xxh3_64"
_CHUNK = 8 << 20


def file_checksum(path: str | Path) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe_files(folder: Path, names: list[str]) -> dict[str, dict[str, object]]:
    """``{name: {"size": bytes, "xxh3_64": hex}}`` for files in ``folder``."""
    out: dict[str, dict[str, object]] = {}
    for name in names:
        path = folder / name
        out[name] = {"size": path.stat().st_size, CHECKSUM_ALGORITHM: file_checksum(path)}
    return out


def rank_files(folder: Path, rank: int) -> list[str]:
    """Data files DCP's filesystem writer wrote for ``rank`` (``__{rank}_{i}.distcp``)."""
    prefix = f"__{rank}_"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(prefix))


MANIFEST_FORMAT = "dcpkit-checkpoint/1"


def build_manifest(
    step: int | None,
    world_size: int,
    groups: list[str],
    files: dict[str, Any],
    dtype: str | None = None,
    mesh: dict[str, Any] | None = None,
    source: str | None = None,
) -> dict[str, Any]:
    """The ``dcpkit.json`` written beside every checkpoint dcpkit publishes."""
    from dcpkit import __version__

    return {
        "format": MANIFEST_FORMAT,
        "step": step,
        "world_size": world_size,
        "mesh": mesh,
        "groups": groups,
        "model_only": groups == ["model"],
        "dtype": dtype,
        "checksum": CHECKSUM_ALGORITHM,
        "files": files,
        "source": source,
        "dcpkit_version": __version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
