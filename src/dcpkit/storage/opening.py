"""The one place that tells local from remote: ``open_store`` and the helpers built on it pick
a local folder or an fsspec store once, above the stores they pick (which import ``base``)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dcpkit.storage.base import CheckpointView

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_url(path: Any) -> bool:
    """An fsspec URL other than ``file://`` (local paths keep dcpkit's rename-based publish)."""
    text = str(path)
    return bool(_URL.match(text)) and not text.startswith("file://")


def local_path(path_or_url: Any) -> Path | None:
    """The local folder ``path_or_url`` names, or None for a URL of a remote store."""
    return None if is_url(path_or_url) else Path(str(path_or_url).removeprefix("file://"))


def open_store(
    path_or_url: str | Path,
    storage_options: dict[str, Any] | None = None,
    base: str | Path | None = None,
) -> Any:
    """The store for a folder or a URL: the one place that tells local from remote. A relative
    path is taken relative to ``base`` when given, a folder or a URL (``s3://bucket/run`` and
    ``checkpoint`` are ``s3://bucket/run/checkpoint``)."""
    relative = not is_url(path_or_url) and not Path(str(path_or_url)).is_absolute()
    if base is not None and relative and is_url(base):
        path_or_url = f"{str(base).rstrip('/')}/{str(path_or_url).removeprefix('./')}"
    if is_url(path_or_url):
        from dcpkit.storage.fsspec import FsspecStore

        return FsspecStore(str(path_or_url), storage_options)
    from dcpkit.storage.local import LocalStore

    path = Path(str(path_or_url).removeprefix("file://"))
    if base is not None and not path.is_absolute():
        path = Path(base) / path
    return LocalStore(path)


def open_location(
    path_or_url: str | Path, storage_options: dict[str, Any] | None = None
) -> tuple[Any, str]:
    """``(store of the parent, name)`` for one checkpoint, file or folder."""
    text = str(path_or_url).rstrip("/") or "/"
    if is_url(text):
        parent, _, name = text.rpartition("/")
        return open_store(parent, storage_options), name
    path = Path(text.removeprefix("file://"))
    return open_store(path.parent, storage_options), path.name


@contextlib.contextmanager
def open_checkpoint(
    path_or_url: str | Path, storage_options: dict[str, Any] | None = None, data: bool = True
) -> Iterator[CheckpointView]:
    """A checkpoint (or file) as the format readers see it; ``data=False`` when no tensor data
    will be read (a remote checkpoint then costs its metadata and its records' headers only)."""
    store, name = open_location(path_or_url, storage_options)
    with store.view(name, data=data) as view:
        yield view
