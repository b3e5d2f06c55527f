"""Checksums of checkpoint files, computed by the rank that wrote them."""

from __future__ import annotations

from pathlib import Path

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
