"""Where the readers get a checkpoint file's bytes: the local file, or, for a metadata-only
local copy of a remote checkpoint (``remote.stream_copy``), the remote original, read in
place by range requests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_ORIGINS: dict[Path, Callable[[str], BinaryIO]] = {}


def register_origin(folder: str | Path, opener: Callable[[str], BinaryIO]) -> None:
    """Files of ``folder`` are read through ``opener(file_name)`` from now on."""
    _ORIGINS[Path(folder).resolve()] = opener


def forget_origin(folder: str | Path) -> None:
    _ORIGINS.pop(Path(folder).resolve(), None)


def open_binary(path: str | Path) -> BinaryIO:
    """A binary file object for reading ``path`` (seek, read, readinto)."""
    p = Path(path)
    opener = _ORIGINS.get(p.parent.resolve())
    return opener(p.name) if opener is not None else open(p, "rb")
