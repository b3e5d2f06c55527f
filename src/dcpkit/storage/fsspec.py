"""Object stores and other fsspec file systems (``s3://``, ``gs://``, ``memory://``, ...):
publish by commit marker.

Rename is not atomic on an object store, so every rank's data, ``.metadata`` and the manifest are
uploaded straight into ``step-N/`` (in parallel parts, hashed on the way: ``transfer.py``), and a
commit marker, written last, makes it a checkpoint. Discovery sees only folders with the marker;
folders without it are abandoned uploads, removed by the next run. Deletion marks the folder as
being deleted, then removes the commit marker, so a half-deleted checkpoint is taken neither for a
complete one nor for an abandoned upload. A load reads the data files by parallel ranged reads
into the destination tensors (``remote_files``), checksumming them in the same pass.

The tools read a remote checkpoint through a metadata-only local copy (``.metadata``, its index
and small files whole, data files as sparse files of their true size, safetensors files as their
header), whose data files are read from the remote originals by range requests as tensors are
asked for. Credentials and endpoint come from the standard environment (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``, ...) or from ``[checkpoint] storage_options``, passed to fsspec as they are.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from dcpkit.layout import (
    COMMIT_MARKER,
    DELETING,
    MANIFEST,
    METADATA,
    METADATA_INDEX,
    STAGING_SUFFIX,
    parse_step,
)
from dcpkit.manifest import (
    CHECKSUM_ALGORITHM,
    CHUNK,
    Problem,
    checksum_stream,
    parse_manifest,
    sealed_bytes,
)
from dcpkit.safe_pickle import safe_reader
from dcpkit.storage.base import (
    CheckpointStore,
    CheckpointView,
    FileStat,
    PendingStep,
    StoreError,
    local_open,
    own_files_of,
)
from dcpkit.storage.messages import explain, scrub
from dcpkit.storage.randomness import imports_kept_off_stream
from dcpkit.storage.randomness import isolate as isolate_randomness
from dcpkit.storage.ranged import RangeFile, RemoteFiles, remote_files
from dcpkit.storage.transfer import READS_IN_FLIGHT, Transport
from dcpkit.storage.upload import fs_options, step_writer, upload_file_system

_SAFETENSORS_HEADER_MAX = 100 << 20  # the format's own limit
_SMALL_FILE = 64 << 20  # other files up to this size are copied (metadata, configs, tokenizers)
_STREAM_BLOCK = 4 << 20  # range request size when tensors are read from the remote files
_STREAM_BLOCKS = 8  # blocks cached per open file: 32 MiB
_HEADER_BLOCK = 64 << 10  # range request size when only records' headers are read


class FsspecStore(CheckpointStore):
    """An fsspec file system and a root URL on it."""

    own_names = frozenset({COMMIT_MARKER, DELETING})
    direct_reads = True
    incomplete_status = "incomplete (upload never committed; removed by the next save)"
    deleting_status = "being deleted by retention (if interrupted, removed by the next save)"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        try:
            with imports_kept_off_stream():
                import fsspec
        except ImportError:
            raise StoreError(
                f"{url}: remote storage needs fsspec and the file system's package "
                "(pip install 'dcpkit[remote]', i.e. fsspec and s3fs)"
            ) from None
        self.root = url.rstrip("/")
        self.storage_options = opts = dict(storage_options or {})
        try:
            with imports_kept_off_stream():  # s3fs's imports draw from Python's random
                isolate_randomness()  # the clients' jitter never draws from the training's
                self.fs, self.path = fsspec.core.url_to_fs(self.root, **fs_options(url, opts))
        except (ImportError, ValueError) as e:
            raise StoreError(scrub(f"{self.root}: {e}", self.storage_options)) from None

    def __reduce__(self) -> Any:
        return (FsspecStore, (self.root, self.storage_options))

    def endpoint(self) -> str | None:
        opts = self.storage_options
        url = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
        url = url or os.environ.get("AWS_ENDPOINT_URL")
        return f"{url} ({self.root})" if url else self.root

    def _explain(self, url: str, e: Exception) -> str:
        return scrub(explain(url, e), self.storage_options)

    def _p(self, name: str = "") -> str:
        return f"{self.path}/{name}" if name else self.path

    def location(self, name: str = "") -> str:
        return f"{self.root}/{name}" if name else self.root

    # -- primitives

    def list_names(self, folder: str = "") -> list[str]:
        try:
            entries = self.fs.ls(self._p(folder), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise StoreError(self._explain(self.location(folder), e)) from None
        own = self._p(folder).rstrip("/")  # an emptied folder may list its own key
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != own)

    def stat(self, name: str) -> FileStat | None:
        self.fs.invalidate_cache()
        try:
            info = self.fs.info(self._p(name))
        except FileNotFoundError:
            return None
        except Exception as e:
            raise StoreError(self._explain(self.location(name), e)) from None
        mtime = info.get("LastModified") or info.get("mtime") or info.get("created")
        if mtime is not None and hasattr(mtime, "timestamp"):
            mtime = mtime.timestamp()
        is_dir = info.get("type") == "directory"
        return FileStat(is_dir, int(info.get("size") or 0), float(mtime) if mtime else None)

    def open_read(self, name: str) -> BinaryIO:
        return self.fs.open(self._p(name), "rb", block_size=CHUNK)

    def checksum(self, name: str) -> str:  # streamed by parallel ranged reads
        size = self.size(name)
        with RangeFile(self.transport, self._p(name), size, [(0, size)], [], READS_IN_FLIGHT) as f:
            return checksum_stream(f)

    def read_bytes(self, name: str) -> bytes:  # one request (no HEAD first)
        return self.fs.cat_file(self._p(name))

    def read_manifest(self, folder: str) -> tuple[dict[str, Any] | None, list[Problem]]:
        try:
            return parse_manifest(self.read_bytes(f"{folder}/{MANIFEST}" if folder else MANIFEST))
        except FileNotFoundError:
            return None, []

    def write_bytes(self, name: str, data: bytes, durable: bool = True) -> None:
        with self.fs.open(self._p(name), "wb") as f:
            f.write(data)

    def remove(self, name: str) -> None:
        path = self._p(name)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path)  # a listing must not see what is gone, nor a leftover
        with contextlib.suppress(FileNotFoundError):  # key of the prefix itself ("name/")
            for left in self.fs.find(path, withdirs=True):
                self.fs.rm_file(left)
        self.fs.invalidate_cache(path)

    def check_reachable(self) -> None:
        bucket = self.path.split("/", 1)[0]
        if "memory" in self.fs.protocol:
            return
        try:
            self.fs.ls(bucket, detail=False, refresh=True)
        except FileNotFoundError:
            raise StoreError(
                f"{self.root}: the bucket {bucket!r} does not exist; create it or fix the URL"
            ) from None
        except PermissionError as e:
            raise StoreError(
                scrub(
                    f"{self.root}: the credentials were rejected ({e}); check AWS_ACCESS_KEY_ID "
                    "/ AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL) or [checkpoint] "
                    "storage_options",
                    self.storage_options,
                )
            ) from None
        except Exception as e:  # botocore/s3fs errors vary by version
            raise StoreError(self._explain(self.root, e)) from None

    def begin(
        self, name: str, step: int | None = None, kill_pid: int | None = None, is_dir: bool = True
    ) -> PendingStep:
        return FsspecPending(self, name, step, kill_pid, is_dir)

    def dcp_reader(self, name: str) -> Any:
        return _reader_class()(self.location(name), **self.storage_options)

    @functools.cached_property
    def transport(self) -> Transport:
        return Transport(self.fs)

    def remote_files(self, name: str) -> tuple[RemoteFiles, Any]:
        """``name``'s files as dcpkit's DCP reader opens them (parallel ranged reads, sizes
        from one listing), and DCP's file system for the rest of what it reads."""
        try:
            entries = self.fs.ls(self._p(name), detail=True, refresh=True)
        except FileNotFoundError:
            entries = []
        except Exception as e:
            raise StoreError(self._explain(self.location(name), e)) from None
        return remote_files(self.transport, self.fs, self._p(name), entries)

    def is_published(self, name: str) -> bool:
        return parse_step(name) is not None and COMMIT_MARKER in self.list_names(name)

    def is_incomplete(self, name: str) -> bool:  # an empty prefix is no upload: nothing is left
        stepped = parse_step(name.removesuffix(STAGING_SUFFIX)) is not None
        names = self.list_names(name) if stepped else []
        return bool(names) and COMMIT_MARKER not in names

    def delete(self, name: str) -> None:
        # Marked first, so that a listing meanwhile tells a deletion from an abandoned upload;
        # uncommitted next, so that no load ever picks a half-deleted step.
        self.write_bytes(f"{name}/{DELETING}", b"")
        self.remove(f"{name}/{COMMIT_MARKER}")
        self.remove(name)

    def incomplete_status_of(self, name: str) -> str:
        deleting = DELETING in self.list_names(name)
        return self.deleting_status if deleting else self.incomplete_status

    def uncommitted_reason(self, name: str) -> str | None:
        names = self.list_names(name)
        if parse_step(name) is not None and MANIFEST in names and COMMIT_MARKER not in names:
            return (
                f"no {COMMIT_MARKER}: the upload never committed, so training does not pick "
                "this step"
            )
        return None

    # -- reading checkpoints in place

    @contextlib.contextmanager
    def view(self, name: str, data: bool = True, metadata: bool = True) -> Iterator[CheckpointView]:
        self.check_reachable()
        st = self.stat(name)
        if st is None:
            raise FileNotFoundError(f"{self.location(name)} does not exist")
        tmp = tempfile.TemporaryDirectory(prefix="dcpkit-remote-")
        try:
            local = Path(tmp.name) / name.rsplit("/", 1)[-1]
            opener: Callable[[Path], BinaryIO] = local_open
            if not st.is_dir:
                self.fs.get(self._p(name), str(local))  # a single file: downloaded whole
            else:
                self._skeleton(name, local, metadata)
                opener = self._range_opener(name, _STREAM_BLOCK if data else _HEADER_BLOCK)
            yield CheckpointView(local, self.location(name), self, name, opener)
        finally:
            tmp.cleanup()

    def _skeleton(self, name: str, dest: Path, metadata: bool = True) -> None:
        """``.metadata`` (unless not ``metadata``), its index and small files whole; ``.distcp``
        and other large files as sparse files of their true size; ``.safetensors`` files as
        their header in a sparse file of their true size."""
        dest.mkdir()
        for entry in self.fs.ls(self._p(name), detail=True, refresh=True):
            if entry.get("type") != "file":
                continue
            file = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            size, local = int(entry["size"]), dest / file
            large = size > _SMALL_FILE and not file.endswith(".safetensors")
            kept = file == METADATA_INDEX or (file == METADATA and metadata)
            if not kept and (file == METADATA or file.endswith(".distcp") or large):
                with open(local, "wb") as f:
                    f.truncate(size)
            elif file.endswith(".safetensors"):
                with self.fs.open(self._p(f"{name}/{file}"), "rb") as src, open(local, "wb") as f:
                    head = src.read(8)
                    n = int.from_bytes(head, "little") if len(head) == 8 else 0
                    f.write(head)
                    if 0 < n <= min(_SAFETENSORS_HEADER_MAX, size - 8):
                        f.write(src.read(n))
                    f.truncate(size)
            else:
                self.fs.get(self._p(f"{name}/{file}"), str(local))

    def _range_opener(self, name: str, block: int) -> Callable[[Path], BinaryIO]:
        """Opens the remote files of ``name`` for ranged reads of ``block`` bytes (a view
        without data reads records' headers only: small blocks)."""

        def opener(path: Path) -> BinaryIO:
            return self.fs.open(
                self._p(f"{name}/{path.name}"),
                "rb",
                block_size=block,
                cache_type="blockcache",
                cache_options={"maxblocks": _STREAM_BLOCKS},
            )

        return opener


@functools.cache
def _reader_class() -> type:
    """DCP's fsspec reader, reading ``.metadata`` without running code."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return safe_reader(FsspecReader)


class FsspecPending(PendingStep):
    """Uploaded straight into ``NAME/``; the commit marker, written last, publishes it."""

    store: FsspecStore

    def __init__(self, store: FsspecStore, name: str, step, kill_pid, is_dir) -> None:  # type: ignore[no-untyped-def]
        super().__init__(store, name, step, kill_pid, is_dir)
        self._scratch: tempfile.TemporaryDirectory | None = None
        self.digests: dict[str, tuple[str, int]] = {}  # taken as this process uploaded them

    def prepare(self) -> None:
        if self.store.exists(self.name):
            self.store.remove(self.name)  # an abandoned upload of this name, or a re-save

    def dcp_writer(self) -> Any:
        store = self.store
        writer = step_writer(store.location(self.name), store.storage_options, self.step)
        writer._kill_pid = self.kill_pid
        writer.fs = upload_file_system(store.fs, store.transport, self.digests)
        writer.digests = self.digests
        return writer

    def scratch(self) -> Path:
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="dcpkit-upload-")
            if self.is_dir:
                (Path(self._scratch.name) / self.name).mkdir()
        return Path(self._scratch.name) / self.name

    def own_files(self, rank: int) -> list[str]:
        return own_files_of(self.store.list_names(self.name), rank)

    def describe(self, names: list[str]) -> dict[str, dict[str, Any]]:
        if self._scratch is not None:  # written locally, uploaded at publish
            from dcpkit.storage.local import LocalStore

            return LocalStore(self.scratch()).describe("", names)
        out, unknown = {}, []
        for name in names:  # DCP writes ``.metadata`` as ``.metadata.tmp`` and renames it
            digest = self.digests.get(name) or self.digests.get(f"{name}.tmp")
            if digest is None:
                unknown.append(name)
            else:
                out[name] = {"size": digest[1], CHECKSUM_ALGORITHM: digest[0]}
        return {**out, **self.store.describe(self.name, unknown)}

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self.store.write_bytes(f"{self.name}/{MANIFEST}", sealed_bytes(manifest))

    def write_file(self, name: str, data: bytes) -> None:
        if self._scratch is not None:  # written locally, uploaded at publish
            (self.scratch() / name).write_bytes(data)
        else:
            self.store.write_bytes(f"{self.name}/{name}", data)
            self.digests[name] = xxhash.xxh3_64_hexdigest(data), len(data)

    def _commit(self) -> None:
        if self._scratch is not None:
            local = self.scratch()
            files = sorted(local.iterdir()) if self.is_dir else [local]
            for path in files:
                target = f"{self.name}/{path.name}" if self.is_dir else self.name
                self.store.fs.put(str(path), self.store._p(target))
            self._scratch.cleanup()
            self._scratch = None
        if self.is_dir:
            self.store.write_bytes(f"{self.name}/{COMMIT_MARKER}", b"")

    def abort(self) -> None:
        self.store.remove(self.name)
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    @contextlib.contextmanager
    def view(self) -> Iterator[CheckpointView]:
        if self._scratch is not None:
            yield CheckpointView(
                self.scratch(), self.store.location(self.name), self.store, self.name
            )
        else:
            with self.store.view(self.name) as view:
                yield view
