"""The manifest (``dcpkit.json``) written with every checkpoint dcpkit publishes.

Every file's size and xxh3-64 checksum, computed by the rank that wrote the file right after
writing it (the bytes are still in the page cache), plus step, world size, mesh and versions.
The manifest carries a checksum of its own content (its seal), so a change to any file, the
manifest included, is found and named. Building, sealing and parsing live here, for every store.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import FileSystem

from dcpkit.layout import MANIFEST, MODEL

FORMAT = "dcpkit-checkpoint/2"
"""2: RNG state as tensors and plain values (1: a pickled blob, still read)."""
KNOWN_FORMATS = ("dcpkit-checkpoint/1", FORMAT)
CHECKSUM_ALGORITHM = "xxh3_64"
SEAL = "manifest_xxh3_64"
CHUNK = 8 << 20


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint, and the file it is in."""

    file: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.message}" if self.file else self.message


class HashingStream(io.RawIOBase):
    """A file being written, hashed (xxh3-64) as its bytes go by. Writes must come in file
    order: a seek to where the bytes hashed so far end keeps the hash; a seek elsewhere gives it
    up (``digest()`` is then None, and the file is checksummed by reading it back)."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.hash, self.size, self.in_order = raw, xxhash.xxh3_64(), 0, True

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self.raw.write(b)
        self.hash.update(b)
        self.size += len(memoryview(b).cast("B"))
        return n

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != io.SEEK_SET or offset != self.size:
            self.in_order = False  # the bytes hashed are no longer the file's
        return self.raw.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        return self.raw.truncate(size)

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.close()
        super().close()

    def digest(self, file_size: int | None = None) -> tuple[str, int] | None:
        """(xxh3-64, size) of the file, when every byte of it (``file_size`` of them, when
        given) went by in order; else None."""
        if not self.in_order or (file_size is not None and file_size != self.size):
            return None
        return self.hash.hexdigest(), self.size


class HashingFileSystem(FileSystem):
    """DCP's file system, recording each written file's checksum in ``digests`` (name ->
    (xxh3-64, size)) so that the manifest need not read the files back."""

    def __init__(self, digests: dict[str, tuple[str, int]]) -> None:
        super().__init__()
        self.digests = digests

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with (
            super().create_stream(path, mode) as raw,
            hashed_stream(raw, mode, self.digests, path) as stream,
        ):
            yield stream


@contextlib.contextmanager
def hashed_stream(
    stream: Any, mode: str, digests: dict[str, tuple[str, int]], path: Any
) -> Iterator[Any]:
    """``stream`` (opened with ``mode``), hashed as it is written: the file's (xxh3-64, size)
    recorded in ``digests`` under its name once the writer is done with it."""
    if "w" not in mode:
        yield stream
        return
    hashing = HashingStream(stream)
    yield hashing
    digest = hashing.digest()
    if digest is not None:
        digests[str(path).rstrip("/").rsplit("/", 1)[-1]] = digest


def checksum_stream(f: BinaryIO) -> str:
    """xxh3-64 of everything ``f`` yields from where it stands."""
    h = xxhash.xxh3_64()
    while chunk := f.read(CHUNK):
        h.update(chunk)
    return h.hexdigest()


def build_manifest(
    step: int | None,
    world_size: int,
    groups: list[str],
    files: dict[str, Any],
    dtype: str | None = None,
    mesh: dict[str, Any] | None = None,
    source: str | None = None,
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``dcpkit.json`` written beside every checkpoint dcpkit publishes. ``model``: the
    model it holds, ``{"family": ..., "config": config.json}`` (an import's own, or one made from
    the trained model's args), so that an export needs no flavor and gives that config back."""
    from dcpkit import __version__

    extra = {"model": model} if model is not None else {}
    return {
        **extra,
        "format": FORMAT,
        "step": step,
        "world_size": world_size,
        "mesh": mesh,
        "groups": groups,
        "model_only": groups == [MODEL],
        "dtype": dtype,
        "checksum": CHECKSUM_ALGORITHM,
        "files": files,
        "source": source,
        "dcpkit_version": __version__,
        "torch_version": torch.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _seal(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != SEAL}
    return xxhash.xxh3_64(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed_bytes(manifest: dict[str, Any]) -> bytes:
    """The manifest as written: with a checksum of its own content."""
    sealed = {**manifest, SEAL: _seal(manifest)}
    return (json.dumps(sealed, indent=1, sort_keys=True) + "\n").encode()


def parse_manifest(data: bytes) -> tuple[dict[str, Any] | None, list[Problem]]:
    """The manifest in ``data`` and what is wrong with it (None when it cannot be used). Strict:
    a duplicate key, a missing seal or a seal that does not match is a problem."""
    try:
        manifest = json.loads(data, object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError) as e:
        return None, [Problem(MANIFEST, f"cannot be parsed ({e}): the manifest is corrupt")]
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None, [Problem(MANIFEST, "is not a dcpkit manifest (no files table)")]
    unknown = format_problem(manifest)
    if unknown is not None:
        return manifest, [unknown]
    seal = manifest.get(SEAL)
    if seal is None:
        return manifest, [Problem(MANIFEST, f"has no {SEAL}: it was altered")]
    if seal != _seal(manifest):
        return manifest, [
            Problem(MANIFEST, "was altered: its content does not match its own checksum")
        ]
    return manifest, []


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def format_problem(manifest: dict[str, Any]) -> Problem | None:
    """A manifest of a format this dcpkit does not know: written by a newer one."""
    fmt = manifest.get("format")
    if fmt in KNOWN_FORMATS:
        return None
    from dcpkit import __version__

    return Problem(
        MANIFEST,
        f"has format {fmt!r}, which dcpkit {__version__} does not know (it reads "
        f"{', '.join(KNOWN_FORMATS)}): it was written by a newer dcpkit; upgrade to load it",
    )
