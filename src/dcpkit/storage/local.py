"""A local (or network-mounted) folder: publish by rename, durably.

A write goes into ``.tmp-NAME``; when it is complete (DCP ``.metadata`` or a Hugging Face index,
and the manifest) one rename makes it ``NAME``, after an fsync of its files' folder. Discovery
only ever sees ``step-N`` folders, so a crash at any moment leaves either the previous
checkpoint as "latest" or the new one, complete. A deletion renames to ``.old-NAME`` first.

A write to a name that exists (Lightning's ``last.ckpt``, rewritten at every save) swaps the two
folders in one ``renameat2(RENAME_EXCHANGE)``, then removes the old one from ``.tmp-NAME``: at
every moment one complete checkpoint is at ``NAME``. Where the file system cannot exchange
(not Linux, some network file systems) it falls back to two renames through ``.old-NAME``, and
whatever finds ``NAME`` missing with a complete ``.tmp-NAME`` beside ``.old-NAME`` finishes
that publish (``LocalStore.recover``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from dcpkit import dist, failpoints
from dcpkit.dist import io_threads
from dcpkit.layout import (
    EXPORT_FILES,
    MANIFEST,
    METADATA,
    OLD_PREFIX,
    STEP_PREFIX,
    TEMP_PREFIX,
    parse_step,
)
from dcpkit.manifest import CHECKSUM_ALGORITHM, HashingFileSystem, checksum_stream, sealed_bytes
from dcpkit.safe_pickle import safe_reader
from dcpkit.storage.base import (
    CheckpointStore,
    CheckpointView,
    FileStat,
    NotAFile,
    PendingStep,
    own_files_of,
)
from dcpkit.storage.frozen import FrozenFiles
from dcpkit.storage.writer import CrashPointWriter

SafeFileSystemReader = safe_reader(FileSystemReader)
"""DCP's file system reader, reading ``.metadata`` without running code."""


FILE_SHARE = 256 << 20
"""Bytes of a rank's share per data file (and writer thread) of a large save."""


class StepFileWriter(CrashPointWriter, FrozenFiles, FileSystemWriter):
    """DCP's file system writer, with the ``mid_write`` crash point; with ``digests``, each
    file's checksum is computed on its bytes as they are written; with ``final`` (the folder it
    is published as), frozen entries are linked from this process's previous save."""

    def __init__(
        self,
        path: Path,
        step: int | None,
        kill_pid: int | None = None,
        digests: dict[str, tuple[str, int]] | None = None,
        final: Path | None = None,
    ) -> None:
        super().__init__(str(path))
        self._step, self._kill_pid, self.digests = step, kill_pid, digests
        self.final = None if final is None else str(final)
        if digests is not None:
            self.fs = HashingFileSystem(digests)

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        # A large share is written as a file per thread (one per 256 MiB, one per core at most):
        # one thread serializes a tensor while another's file goes to disk. A small one stays a
        # single file per rank.
        nbytes = sum(
            i.tensor_data.size.numel() * i.tensor_data.properties.dtype.itemsize
            for i in plan.items
            if i.tensor_data is not None
        )
        self.thread_count = max(1, min(io_threads(), nbytes // FILE_SHARE))
        return super().write_data(plan, planner)


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes, sync: bool = True) -> None:
    """``data`` as the whole of ``path``, replaced in one rename (synced first with ``sync``)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux's ``renameat2`` with ``RENAME_EXCHANGE``).
    False where the system or the file system cannot; other failures raise."""
    try:
        call = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    done = call(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"cannot swap {b} with its new version: {os.strerror(err)}", str(a))


def open_regular(path: str | Path) -> BinaryIO:
    """``open(path, "rb")`` for a regular file only (links followed): a FIFO would block the
    open or the read forever and a device (``/dev/zero``) never ends, so neither is opened
    for reading (``NotAFile``, naming the file and what it is; a folder: ``IsADirectoryError``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, "is a folder", str(path))
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else (
                "a device")  # fmt: skip
            raise NotAFile(
                errno.EINVAL, f"is {kind}, not a regular file: a checkpoint folder's files are "
                "read only when they are files", str(path),
            )  # fmt: skip
        os.set_blocking(fd, True)
        f = open(fd, "rb")  # noqa: SIM115 (the caller closes it)
        f.raw.name = str(path)  # as open(path) names it
        return f
    except BaseException:
        os.close(fd)
        raise


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class LocalStore(CheckpointStore):
    """A folder on a file system with atomic rename."""

    direct_reads = True

    def __init__(self, root: str | Path) -> None:
        self.path = Path(root)
        self.root = str(self.path)
        self.storage_options: dict[str, Any] = {}

    def __reduce__(self) -> Any:
        return (LocalStore, (self.path,))

    def _p(self, name: str) -> Path:
        return self.path / name if name else self.path

    def location(self, name: str = "") -> str:
        return str(self._p(name))

    def list_names(self, folder: str = "") -> list[str]:
        try:
            return sorted(os.listdir(self._p(folder)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def stat(self, name: str) -> FileStat | None:
        p = self._p(name)
        try:
            st = p.stat()
        except FileNotFoundError:
            return None
        return FileStat(p.is_dir(), st.st_size, st.st_mtime)

    def open_read(self, name: str) -> BinaryIO:
        return open_regular(self._p(name))

    def checksum(self, name: str) -> str:
        with open_regular(self._p(name)) as f:
            return checksum_stream(f)

    def write_bytes(self, name: str, data: bytes, durable: bool = True) -> None:
        # A marker's folder (.dcpkit-holds) is removed by whoever empties it: it may vanish
        # between the mkdir that finds it there and the write, or inside the mkdir (which then
        # raises FileExistsError for a folder that is no longer there): make it and try again.
        path = self._p(name)
        attempts = 10
        for attempt in range(attempts):
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                write_durably(path, data, sync=durable)
                return
            except (FileNotFoundError, FileExistsError):
                if attempt == attempts - 1 or path.parent.is_file():
                    raise

    def remove_empty_folder(self, name: str) -> None:
        with contextlib.suppress(OSError):  # not empty (someone wrote into it), or gone
            os.rmdir(self._p(name))

    def remove(self, name: str) -> None:
        _remove_path(self._p(name))

    def check_reachable(self) -> None:
        return None

    def space(self) -> tuple[int, int] | None:
        path = self.path
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            usage = shutil.disk_usage(path)
        except OSError:
            return None
        return usage.free, usage.total

    def begin(
        self, name: str, step: int | None = None, kill_pid: int | None = None, is_dir: bool = True
    ) -> PendingStep:
        return LocalPending(self, name, step, kill_pid, is_dir)

    def dcp_reader(self, name: str) -> Any:
        return SafeFileSystemReader(self.location(name))

    def local_dir(self, name: str) -> Path | None:
        return self._p(name)

    def recover(self, name: str) -> None:
        """Finish a rewrite of ``name`` that stopped between its two renames (the fallback of
        ``LocalPending._commit``): ``name`` missing, the old one at ``.old-NAME``, the new one
        complete (its manifest written) at ``.tmp-NAME``."""
        if not name or "/" in name or self._p(name).exists():
            return
        old, new = self._p(f"{OLD_PREFIX}{name}"), self._p(f"{TEMP_PREFIX}{name}")
        if old.exists() and (new / MANIFEST).is_file():
            os.replace(new, self._p(name))
            fsync_dir(self.path)
            _remove_path(old)

    def holds_checkpoint(self, name: str) -> bool:
        self.recover(name)
        return super().holds_checkpoint(name)

    @contextlib.contextmanager
    def view(self, name: str, data: bool = True, metadata: bool = True) -> Iterator[CheckpointView]:
        self.recover(name)
        path = self._p(name)
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        yield CheckpointView(path, str(path), self, name)

    def is_published(self, name: str) -> bool:
        return (
            parse_step(name) is not None and self._p(name).is_dir() and self.holds_checkpoint(name)
        )

    def is_incomplete(self, name: str) -> bool:
        if not self._p(name).is_dir():
            return False
        if name.startswith((TEMP_PREFIX + STEP_PREFIX, OLD_PREFIX + STEP_PREFIX)):
            return True
        # step-N folders without metadata: written by something that crashed before finishing.
        return parse_step(name) is not None and not self.holds_checkpoint(name)

    def delete(self, name: str) -> None:
        # Rename first so that a crash half-way through the delete never leaves a step-N
        # folder that looks complete but is missing files.
        trash = self._p(f"{OLD_PREFIX}{name}")
        _remove_path(trash)
        try:
            os.replace(self._p(name), trash)
        except FileNotFoundError:
            return  # deleted already
        _remove_path(trash)


class LocalPending(PendingStep):
    """``.tmp-NAME``, renamed to ``NAME`` when published."""

    store: LocalStore

    def __init__(self, store: LocalStore, name: str, step, kill_pid, is_dir) -> None:  # type: ignore[no-untyped-def]
        super().__init__(store, name, step, kill_pid, is_dir)
        self.tmp = store.path / f"{TEMP_PREFIX}{name}"
        self.final = store.path / name
        self.digests: dict[str, tuple[str, int]] = {}  # checksums taken as files were written

    def prepare(self) -> None:
        # What an earlier attempt left; anything else in the way makes the write fail, naming it.
        if self.tmp.is_dir() == self.is_dir:
            _remove_path(self.tmp)
        self.tmp.parent.mkdir(parents=True, exist_ok=True)
        if self.is_dir:
            self.tmp.mkdir()

    def dcp_writer(self) -> Any:
        return StepFileWriter(self.tmp, self.step, self.kill_pid, self.digests, self.final)

    def scratch(self) -> Path:
        return self.tmp

    def own_files(self, rank: int) -> list[str]:
        return own_files_of(os.listdir(self.tmp), rank)

    def describe(self, names: list[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name in names:
            path = self.tmp / name
            size = path.stat().st_size
            # DCP writes ``.metadata`` as ``.metadata.tmp`` and renames it
            digest, written = self.digests.get(name) or self.digests.get(f"{name}.tmp", ("", -1))
            if written != size:  # not written by this process's DCP writer: read it back
                with open(path, "rb") as f:
                    digest = checksum_stream(f)
            out[name] = {"size": size, CHECKSUM_ALGORITHM: digest}
        return out

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        write_durably(self.tmp / MANIFEST, sealed_bytes(manifest))

    def write_file(self, name: str, data: bytes) -> None:
        write_durably(self.tmp / name, data)
        self.digests[name] = xxhash.xxh3_64_hexdigest(data), len(data)

    def _commit(self) -> None:
        if self.is_dir:
            names = set(os.listdir(self.tmp))
            if METADATA not in names and not names & EXPORT_FILES:
                raise RuntimeError(
                    f"refusing to publish {self.tmp}: it holds no complete checkpoint"
                )
            fsync_dir(self.tmp)
        old = None
        if self.final.exists() and exchange(self.tmp, self.final):  # the new one in its place
            fsync_dir(self.final.parent)
            failpoints.hit("mid_publish", self.step, dist.rank(), self.kill_pid)
            _remove_path(self.tmp)  # the old one, now
            return
        if self.final.exists():
            old = self.final.with_name(f"{OLD_PREFIX}{self.final.name}")
            _remove_path(old)
            os.replace(self.final, old)
            failpoints.hit("mid_publish", self.step, dist.rank(), self.kill_pid)
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        if old is not None:
            _remove_path(old)

    def abort(self) -> None:
        _remove_path(self.tmp)

    @contextlib.contextmanager
    def view(self) -> Iterator[CheckpointView]:
        yield CheckpointView(self.tmp, str(self.tmp), self.store, self.tmp.name)
