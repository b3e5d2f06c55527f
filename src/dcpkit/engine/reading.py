"""Reading a DCP checkpoint into a template: which reader (direct reads of local or remote
files, else the store's own), ``dcp.load`` with each rank planning its own reads, and what every
rank learns after it (errors, checksum problems, the bytes read from storage)."""

from __future__ import annotations

import logging
import tempfile
import weakref
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dcpkit import dist
from dcpkit.engine.together import OTHER, TRANSIENT, failure_of, raise_failure
from dcpkit.errors import CheckpointError, CorruptCheckpoint, first_failure, transient
from dcpkit.formats.dcp_index import DcpIndex, bound_index
from dcpkit.formats.dcp_reader import DirectFileSystemReader
from dcpkit.layout import METADATA, METADATA_INDEX
from dcpkit.manifest import CHUNK
from dcpkit.safe_pickle import UnsafeCheckpoint, safe_load_planner
from dcpkit.units import human_bytes

logger = logging.getLogger(__name__)


class FailedVerification(CorruptCheckpoint):
    """A load found files of the checkpoint that do not match their manifest checksums."""

    def __init__(self, location: str, problems: list[str]) -> None:
        super().__init__(f"{location} failed verification: {'; '.join(problems[:5])}")
        self.problems = problems


def load_failure(e: BaseException, location: str) -> CheckpointError:
    """What ``dcp.load`` of checkpoint ``location`` raised (a ``CheckpointException`` wraps
    what a rank raised, with a traceback in its message), as one error naming the checkpoint:
    a ``CorruptCheckpoint`` when a rule of the format was broken."""
    failure = first_failure(e)
    broken = isinstance(failure, CorruptCheckpoint | UnsafeCheckpoint)
    return (CorruptCheckpoint if broken else CheckpointError)(f"{location}: {failure}")


def load_into(
    template: dict[str, Any],
    reader: Any,
    location: str,
    gather: bool,
    stored: int = 0,
) -> None:
    """``dcp.load`` of ``template`` through ``reader``, each rank planning its own reads: a
    load's global plan is every rank's local plan unchanged, so DCP's exchange of the plans
    (pickled, gathered, scattered back) and its barrier after the reads cost time and decide
    nothing. What DCP's collectives did besides is done here in one gather (``gather``): every
    rank fails when one did, and checksum problems found by any rank are reported by all.
    With ``gather``, records that several ranks need are read once and shared (dcpkit's reader:
    ``formats/shared_read.py``); the bytes the ranks read from storage are logged beside the
    checkpoint's ``stored`` bytes. A failure is raised on every rank, as a ``StoreUnavailable``
    when the store stopped answering (the load retries it)."""
    error, kind = None, OTHER
    if gather and isinstance(reader, DirectFileSystemReader):
        reader.shared = True  # every rank joins the reader's one exchange, failed or not
    try:
        with dist.quiet_single_process():
            dcp.load(template, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
    except (CheckpointException, UnsafeCheckpoint) as e:
        error, kind = failure_of(load_failure(e, location), location)
        if transient(first_failure(e)):
            kind = TRANSIENT
    finally:
        if getattr(reader, "shared", False):  # failed before reading: the others must not wait
            reader.join_failed()
    problems = [str(p) for p in getattr(reader, "problems", [])]
    read = getattr(reader, "bytes_read", None)
    mine = (error, problems, read, kind)
    outcomes = dist.all_gather_object(mine) if gather else [mine]
    errors = [(r, e, k) for r, (e, _, _, k) in enumerate(outcomes) if e is not None]
    if errors:
        rank, first, kind = errors[0]
        where = f" (rank {rank})" if gather and dist.world_size() > 1 else ""  # the same on all
        raise_failure(f"{first}{where}", kind)
    found = sorted({p for _, part, _, _ in outcomes for p in part})
    if found:
        raise FailedVerification(location, found)
    counts = [n for _, _, n, _ in outcomes]
    if stored and None not in counts and dist.rank() == 0:
        total = sum(counts)
        how = "records read once, sent" if getattr(reader, "was_shared", False) else "each its own"
        logger.info(
            "checkpoint: read %s from storage for %s stored (%.2fx) on %d rank(s) (%s)",
            human_bytes(total),
            human_bytes(stored),
            total / stored,
            len(counts),
            how,
        )


def dcp_reader(
    store: Any,
    name: str,
    checksums: dict[str, str] | None = None,
    metadata: Any = None,
    manifest: Any = None,
    index: DcpIndex | None = None,
) -> tuple[Any, DcpIndex | None]:
    """The reader of checkpoint ``name`` (direct reads into the destination tensors, of local
    files or of remote ones by parallel ranged reads, verifying ``checksums`` as they stream
    through; else the store's own), and the index of its ``.metadata`` to plan from when
    ``manifest`` lists one (``index``: the one the checks read already; a remote one is
    downloaded alone). No index when ``metadata`` (parsed by the checks) is given."""
    folder = store.local_dir(name)
    if metadata is not None:
        index = None
    elif index is None and folder is not None:
        index = bound_index(Path(folder), manifest)
    elif index is None:
        index = _remote_index(store, name, manifest)
    if folder is not None:
        return DirectFileSystemReader(folder, checksums=checksums, metadata=metadata), index
    if (remote := store.remote_files(name)) is not None:  # parallel ranged reads
        files, fs = remote
        return DirectFileSystemReader(files.folder, None, checksums, metadata, files, fs), index
    if checksums:
        raise ValueError(f"{store.location(name)}: this store cannot verify while it loads")
    return store.dcp_reader(name), index


def _remote_index(store: Any, name: str, manifest: Any) -> DcpIndex | None:
    """The index of remote checkpoint ``name``'s ``.metadata`` when its manifest lists one:
    downloaded alone (at most the bytes the manifest gives it) into a temporary folder that
    is removed with the index."""
    listed = ((manifest or {}).get("files") or {}).get(METADATA_INDEX)
    if not isinstance(listed, dict) or not isinstance(listed.get("size"), int):
        return None
    tmp, index = tempfile.TemporaryDirectory(prefix="dcpkit-index-"), None
    try:
        folder, left = Path(tmp.name), listed["size"]
        path = f"{name}/{METADATA_INDEX}"
        with store.open_read(path) as src, open(folder / METADATA_INDEX, "wb") as dst:
            while left > 0 and (block := src.read(min(left, CHUNK))):
                dst.write(block)
                left -= len(block)
        stat = store.stat(f"{name}/{METADATA}")
        index = bound_index(folder, manifest, stat.size if stat is not None else None)
    except FileNotFoundError:  # listed but missing: the manifest check reports it
        index = None
    finally:
        if index is None:
            tmp.cleanup()
        else:
            weakref.finalize(index, tmp.cleanup)
    return index
