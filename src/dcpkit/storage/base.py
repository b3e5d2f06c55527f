"""Where checkpoint bytes live: one protocol, two stores, chosen once.

A ``CheckpointStore`` is a root (a local folder, or an fsspec URL such as ``s3://bucket/run``)
holding named entries: ``step-N`` checkpoints, or any file or folder a tool reads or writes. The
engine, the tools and the conversions ask the store; only ``open_store`` asks whether a path is
a URL. What differs between stores is how a write becomes visible (publish by rename, or by a
commit marker written last) and how a deletion avoids leaving something that looks complete.

Writing, in the order every writer calls it (Orbax's temporary-path idea)::

    pending = store.begin(name, step)      # nothing of it is visible yet
    pending.prepare()                      # rank 0, before any write
    dcp.save(..., storage_writer=pending.dcp_writer())   # or files written into pending.scratch()
    files = pending.describe(pending.own_files(rank))    # every rank: sizes and checksums
    pending.write_manifest(manifest)       # rank 0
    pending.publish()                      # rank 0: one rename, or the commit marker
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from dcpkit import dist, failpoints
from dcpkit.layout import (
    EXPORT_FILES,
    MANIFEST,
    METADATA,
    STEP_PREFIX,
    parse_step,
    rank_file_prefix,
)
from dcpkit.manifest import CHECKSUM_ALGORITHM, Problem, checksum_stream, parse_manifest

logger = logging.getLogger(__name__)


class NotAFile(OSError):
    """A name read as a file of a checkpoint folder is a FIFO, a device or a socket."""


class StoreError(RuntimeError):
    """A store cannot be used; the message names the location and what to check."""


def local_open(path: Path) -> BinaryIO:
    return open(path, "rb")


@dataclass
class CheckpointView:
    """A checkpoint as the format readers see it: a local ``path`` (the checkpoint itself, or a
    metadata-only copy of a remote one) and the ``opener`` that reads its files' bytes."""

    path: Path
    location: str
    """What to call it in messages: the path or the URL."""
    store: CheckpointStore
    name: str
    opener: Callable[[Path], BinaryIO] = local_open


@dataclass
class FileStat:
    is_dir: bool
    size: int
    mtime: float | None


FOREIGN_STEP = (
    "foreign: not a step's name (step- and ASCII digits, no leading zero), never read as a step"
)


@dataclass
class StepEntry:
    """One checkpoint-like entry of a checkpoint folder, for ``dcpkit list``."""

    name: str
    step: int | None
    size: int
    mtime: float | None
    status: str
    published: bool


class PendingStep(ABC):
    """A checkpoint (or conversion output) being written; invisible until ``publish()``."""

    digests: dict[str, tuple[str, int]] | None = None
    """Where a writer of local files records each file's checksum as it writes it (name ->
    (xxh3-64, size)); ``describe`` then does not read it back. None: not offered."""

    def __init__(
        self,
        store: CheckpointStore,
        name: str,
        step: int | None,
        kill_pid: int | None,
        is_dir: bool,
    ) -> None:
        self.store, self.name, self.step, self.kill_pid, self.is_dir = (
            store,
            name,
            step,
            kill_pid,
            is_dir,
        )

    @abstractmethod
    def prepare(self) -> None:
        """Rank 0, before any write: remove what an earlier attempt left under this name."""

    @abstractmethod
    def dcp_writer(self) -> Any:
        """A DCP ``StorageWriter`` into this pending step."""

    @abstractmethod
    def scratch(self) -> Path:
        """A local folder (or file, for a file output) that writers of local files fill."""

    @abstractmethod
    def own_files(self, rank: int) -> list[str]:
        """The data files DCP wrote for ``rank``."""

    @abstractmethod
    def describe(self, names: list[str]) -> dict[str, dict[str, Any]]:
        """``{name: {"size": bytes, "xxh3_64": hex}}`` of written files."""

    @abstractmethod
    def write_manifest(self, manifest: dict[str, Any]) -> None: ...

    @abstractmethod
    def write_file(self, name: str, data: bytes) -> None:
        """Write file ``name`` of the step (beside DCP's files, before the manifest)."""

    @abstractmethod
    def _commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None:
        """Remove everything written (a failed conversion leaves no partial output)."""

    @abstractmethod
    def view(self) -> contextlib.AbstractContextManager[CheckpointView]:
        """The written, unpublished files as the format readers see them."""

    def publish(self) -> None:
        """Make the entry visible, in one step that a crash cannot leave half done."""
        rank = dist.rank()
        failpoints.hit("before_publish", self.step, rank, self.kill_pid)
        self._commit()
        failpoints.hit("after_publish", self.step, rank, self.kill_pid)

    def local_files(self) -> list[str]:
        """Every file written into ``scratch()`` except the manifest."""
        root = self.scratch()
        return sorted(p.name for p in root.iterdir() if p.is_file() and p.name != MANIFEST)


class CheckpointStore(ABC):
    """A root holding checkpoints and files. Primitives per store; the rest is shared."""

    root: str
    storage_options: dict[str, Any]
    own_names: frozenset[str] = frozenset()
    """Names the store itself adds to a checkpoint folder (never listed in a manifest)."""
    incomplete_status = "incomplete (interrupted save; never loaded, removed by the next save)"
    direct_reads = False  # dcpkit's DCP reader reads it (``local_dir`` or ``remote_files``)

    # -- primitives ------------------------------------------------------------------------------

    @abstractmethod
    def location(self, name: str = "") -> str:
        """The path or URL of ``name`` (the root when empty)."""

    @abstractmethod
    def list_names(self, folder: str = "") -> list[str]:
        """Names in the root (or in ``folder``), sorted; empty when it does not exist."""

    @abstractmethod
    def stat(self, name: str) -> FileStat | None: ...

    @abstractmethod
    def open_read(self, name: str) -> BinaryIO: ...

    @abstractmethod
    def write_bytes(self, name: str, data: bytes, durable: bool = True) -> None:
        """Write a whole (small) file, at once; ``durable``: on stable storage when this
        returns (a marker that lives seconds, rewritten often, need not: its sync would wait
        for every other dirty page of the file system, a save's among them)."""

    def remove_empty_folder(self, name: str) -> None:
        """Remove folder ``name`` if it is empty, in one step (nothing on an object store,
        where folders are only prefixes)."""
        return None

    @abstractmethod
    def remove(self, name: str) -> None:
        """Remove a file or a folder with everything in it; nothing when it is missing."""

    @abstractmethod
    def check_reachable(self) -> None:
        """Fail early, naming the location, when the store cannot be used."""

    @abstractmethod
    def begin(
        self, name: str, step: int | None = None, kill_pid: int | None = None, is_dir: bool = True
    ) -> PendingStep: ...

    def local_dir(self, name: str) -> Path | None:
        """The folder of ``name`` on this machine's file system, when the store is one (its
        DCP data can then be read with direct file reads); None otherwise."""
        return None

    @abstractmethod
    def dcp_reader(self, name: str) -> Any:
        """A DCP ``StorageReader`` of checkpoint ``name``."""

    def remote_files(self, name: str) -> tuple[Any, Any] | None:
        """The files of remote checkpoint ``name`` as dcpkit's DCP reader opens them (see
        ``formats.dcp_reader.LocalFiles``) and DCP's file system on it; None: not offered."""
        return None

    @abstractmethod
    def view(
        self, name: str, data: bool = True, metadata: bool = True
    ) -> contextlib.AbstractContextManager[Any]:
        """``name`` as a ``CheckpointView``; FileNotFoundError naming it when it is missing.
        ``data=False``: only records' headers will be read (a remote store reads small ranges).
        ``metadata=False``: a remote ``.metadata`` may stay a stand-in of its size (for a check
        that reads its index instead)."""

    @abstractmethod
    def is_published(self, name: str) -> bool:
        """A ``step-N`` entry that discovery may load (the store's publish rule)."""

    @abstractmethod
    def is_incomplete(self, name: str) -> bool:
        """An entry left by an interrupted write: never loaded, removed by the next save."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Delete a checkpoint so that no crash can leave it looking complete."""

    def endpoint(self) -> str | None:
        """The server the store talks to, for messages (None for a local folder)."""
        return None

    def space(self) -> tuple[int, int] | None:
        """``(free, total)`` bytes where the store writes, where it can tell."""
        return None

    def uncommitted_reason(self, name: str) -> str | None:
        """Why a written checkpoint is not published, where the store can tell."""
        return None

    # -- shared ----------------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        return self.stat(name) is not None

    def size(self, name: str) -> int:
        st = self.stat(name)
        if st is None:
            raise FileNotFoundError(f"{self.location(name)} does not exist")
        return st.size

    def read_bytes(self, name: str) -> bytes:
        with self.open_read(name) as f:
            return f.read()

    def checksum(self, name: str) -> str:
        with self.open_read(name) as f:
            return checksum_stream(f)

    def describe(self, folder: str, names: list[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for n in names:
            path = f"{folder}/{n}" if folder else n
            out[n] = {"size": self.size(path), CHECKSUM_ALGORITHM: self.checksum(path)}
        return out

    def holds_checkpoint(self, name: str) -> bool:
        """DCP metadata, or a Hugging Face index or single file, in folder ``name``."""
        names = set(self.list_names(name))
        return METADATA in names or bool(names & EXPORT_FILES)

    def published_steps(self) -> list[int]:
        """Steps of the published checkpoints, ascending."""
        return sorted(
            step
            for name in self.list_names()
            if (step := parse_step(name)) is not None and self.is_published(name)
        )

    def latest_step(self) -> int | None:
        steps = self.published_steps()
        return steps[-1] if steps else None

    def incomplete_status_of(self, name: str) -> str:
        """What ``dcpkit list`` says of the incomplete entry ``name``."""
        return self.incomplete_status

    def incomplete_names(self) -> list[str]:
        return [n for n in self.list_names() if self.is_incomplete(n)]

    def remove_incomplete(self) -> list[str]:
        """Remove what interrupted saves left behind; returns their names."""
        removed = self.incomplete_names()
        for name in removed:
            logger.warning("removing %s, left by an interrupted save", self.location(name))
            self.remove(name)
        return removed

    def read_manifest(self, folder: str) -> tuple[dict[str, Any] | None, list[Problem]]:
        """The manifest of ``folder`` (None when it has none) and what is wrong with it."""
        name = f"{folder}/{MANIFEST}" if folder else MANIFEST
        if not self.exists(name):
            return None, []
        try:
            data = self.read_bytes(name)
        except NotAFile as e:
            return None, [Problem(MANIFEST, f"{e.strerror}: {e.filename}")]
        return parse_manifest(data)

    def tree_size(self, name: str) -> int:
        st = self.stat(name)
        if st is None:
            return 0
        if not st.is_dir:
            return st.size
        return sum(self.tree_size(f"{name}/{n}") for n in self.list_names(name))

    def _named(self, name: str) -> bool:
        """A published dcpkit checkpoint under a name of its writer's choosing (Lightning's
        ``epoch=1-step=16.ckpt``, ``last.ckpt``): a folder with a checkpoint and a manifest."""
        if name.startswith((".", STEP_PREFIX)):  # a step's name, or one no step may have
            return False
        st = self.stat(name)
        return bool(st is not None and st.is_dir and self.holds_checkpoint(name)) and (
            self.read_manifest(name)[0] is not None
        )

    def entries(self) -> list[StepEntry]:
        """Every checkpoint-like entry: published checkpoints (``step-N``, and dcpkit's folders
        named otherwise: Lightning's) and interrupted leftovers."""
        rows = []
        for name in self.list_names():
            step = parse_step(name)
            if self.is_incomplete(name):
                digits = name.rsplit("-", 1)[-1].split(".")[0]
                step = int(digits) if digits.isdigit() else None
                status, published = self.incomplete_status_of(name), False
            elif (step is not None and self.is_published(name)) or self._named(name):
                manifest, _ = self.read_manifest(name)
                if step is None and manifest is not None:  # a folder named by a framework
                    step = manifest.get("step") if isinstance(manifest.get("step"), int) else None
                if manifest is None:
                    status = "published (no dcpkit manifest)"
                elif manifest.get("model_only"):
                    status = f"published, model only ({manifest.get('dtype')})"
                else:
                    status = f"published, {manifest.get('world_size')} rank(s)"
                published = True
            elif step is None and name.startswith(STEP_PREFIX):
                status, published = FOREIGN_STEP, False
            else:
                continue
            st = self.stat(name)
            mtime = st.mtime if st is not None else None
            rows.append(StepEntry(name, step, self.tree_size(name), mtime, status, published))
        rows.sort(key=lambda r: (r.step is None, r.step or 0, r.name))
        return rows


def own_files_of(names: list[str], rank: int) -> list[str]:
    prefix = rank_file_prefix(rank)
    return sorted(n for n in names if n.startswith(prefix))
