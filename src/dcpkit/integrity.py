"""Checksums and structure checks: the manifest written with every checkpoint, and ``verify``.

Every file's size and xxh3-64 checksum go into ``dcpkit.json``, computed by the rank that wrote
the file right after writing it (the bytes are still in the page cache). The manifest carries a
checksum of its own content, so a change to any file, the manifest included, is found and named.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
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


def data_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder except the manifest itself."""
    from dcpkit.layout import MANIFEST

    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST)


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


MANIFEST_SEAL = "manifest_xxh3_64"


def _seal(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != MANIFEST_SEAL}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``dcpkit.json`` with a checksum of its own content, durably."""
    from dcpkit.layout import MANIFEST, write_json_durably

    sealed = dict(manifest)
    sealed[MANIFEST_SEAL] = _seal(manifest)
    write_json_durably(folder / MANIFEST, sealed)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, and the file it is in."""

    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.message}" if self.file else self.message


def load_manifest(folder: Path) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The manifest (None when the checkpoint has none) and what is wrong with it."""
    from dcpkit.layout import MANIFEST

    path = folder / MANIFEST
    if not path.exists():
        return None, []
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        return None, [Problem(MANIFEST, f"cannot be parsed ({e}): the manifest is corrupt")]
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, [Problem(MANIFEST, "is not a dcpkit manifest (no files table)")]
    seal = manifest.get(MANIFEST_SEAL)
    if seal is not None and seal != _seal(manifest):
        return manifest, [
            Problem(MANIFEST, "was altered: its content does not match its own checksum")
        ]
    return manifest, []


def check_files(
    folder: Path,
    manifest: dict[str, Any],
    names: list[str] | None = None,
    checksums: bool = True,
    checksum_of: Callable[[str], str] | None = None,
) -> list[Problem]:
    """Sizes and checksums of the manifest's files (``names``: only these). ``checksum_of``
    computes a file's checksum from its name elsewhere than in ``folder`` (a remote copy)."""
    problems = []
    for name, expected in manifest["files"].items():
        if names is not None and name not in names:
            continue
        path = folder / name
        if not path.is_file():
            problems.append(Problem(name, "is missing"))
            continue
        size = path.stat().st_size
        if size != expected.get("size"):
            problems.append(
                Problem(
                    name,
                    f"has {size} bytes, the manifest says "
                    f"{expected.get('size')}: truncated or replaced",
                )
            )
            continue
        if not checksums:
            continue
        actual = checksum_of(name) if checksum_of is not None else file_checksum(path)
        if expected.get(CHECKSUM_ALGORITHM) != actual:
            problems.append(
                Problem(name, "checksum mismatch: the file's bytes changed after it was written")
            )
    return problems


def unlisted_files(folder: Path, manifest: dict[str, Any]) -> list[Problem]:
    from dcpkit.layout import COMMIT_MARKER, MANIFEST

    listed = set(manifest["files"]) | {MANIFEST, COMMIT_MARKER}
    return [
        Problem(p.name, "is not listed in the manifest")
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name not in listed
    ]
