"""A DCP ``StorageReader`` for local files that reads each stored chunk straight into its
destination tensor.

DCP's own ``FileSystemReader`` deserializes every stored chunk into a temporary tensor with
``torch.load`` and then copies the part it needs into the destination: the bytes are copied two
or three times, one chunk after another. This reader parses each chunk's ``torch.save`` record
itself (the allow-list parser of ``dcpkit.formats.torchfile``, which runs no code), and reads the
rows the destination needs with ``readinto`` into the destination's own memory when it is a
contiguous CPU tensor of the stored dtype (every FSDP shard, every replicated tensor); other
destinations (a column slice, another dtype, a GPU tensor) get the stored rows read once and
copied. The reads of a rank are split into byte-balanced runs over ``thread_count`` threads,
each with its own file handles (file reads release the GIL).

It stays a ``FileSystemReader`` (same metadata, same plans): every checkpoint DCP or TorchTitan
wrote loads, at any layout; chunks with transforms (DCP's compression) are read by DCP's path.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import threading
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from dcpkit.dist import io_threads
from dcpkit.errors import CorruptCheckpoint, transient
from dcpkit.formats import shared_read, torchfile
from dcpkit.formats.dcp_index import Region
from dcpkit.formats.rules import (
    open_record,
    record_problem,
    storage_entry_problem,
    transform_problem,
)
from dcpkit.formats.torchfile import TensorRef, TorchSaveFile
from dcpkit.manifest import Problem
from dcpkit.safe_pickle import safe_reader


class DirectFileSystemReader(safe_reader(FileSystemReader)):  # type: ignore[misc]
    """Reads stored chunks straight into the destination tensors, in parallel."""

    def __init__(
        self,
        path: str | os.PathLike,
        thread_count: int | None = None,
        checksums: dict[str, str] | None = None,
        metadata: Any = None,
        files: Any = None,
        fs: Any = None,
    ) -> None:
        """``checksums``: file name -> expected xxh3-64 of the files this rank verifies while it
        loads (each hashed in one pass as its bytes stream through, the bytes the load does not
        need read only to be hashed); their problems, and any read failure, are then collected
        in ``problems`` instead of raised. ``metadata``: the checkpoint's, already parsed (see
        ``adopt_metadata``; a rank's share of it, from the index of ``.metadata``). ``files``:
        opens the data files (``LocalFiles``, or a remote store's own, which streams the bytes a
        load walks); ``fs``: DCP's file system to read ``.metadata`` and transformed records
        through, instead of the local one."""
        super().__init__(path)
        if fs is not None:
            self.fs = fs
        self.files = files or LocalFiles(path)
        self.workers = 1
        self.shared = False  # set when every rank loads at once: replicas read once (see below)
        self.was_shared = False  # the records were read once and sent to the ranks needing them
        self.bytes_read = 0  # from storage, by this rank
        self._count = threading.Lock()
        if metadata is not None:
            self.adopt_metadata(metadata)
        self.thread_count = thread_count or io_threads()
        self.checksums = dict(checksums or {})
        self.problems: list[Problem] = []

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        items, transformed = [], False
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            name, transforms = info.relative_path, getattr(info, "transform_descriptors", None)
            if transforms:  # read by DCP's own path, when they are transforms it can undo
                if problem := transform_problem(
                    item.storage_index.fqn, name, transforms, bool(self.checksums)
                ):
                    raise CorruptCheckpoint(f"{self.path}/{name}: {problem}")
                transformed = True
            items.append((info.relative_path, info.offset, info.length, item))
        items.sort(key=lambda x: (x[0], x[1]))
        if self.shared and self._read_shared(items, planner, not transformed):
            return _done()
        if transformed:  # (a step with checksums has none: refused above)
            return super().read_data(plan, planner)
        verified = {name: [e for e in items if e[0] == name] for name in self.checksums}
        rest = [e for e in items if e[0] not in self.checksums]
        units: list[Any] = [(self._verify_file, name, run) for name, run in verified.items()]
        units += [(self._read_run, run) for run in _split(rest, self.thread_count)]
        units.sort(key=lambda u: -sum(e[2] for e in u[-1]))  # largest first
        self.workers = max(1, min(len(units), self.thread_count))
        if len(units) <= 1:
            for fn, *args in units:
                self._guarded(fn, *args, planner)
        else:
            workers = min(len(units), self.thread_count)
            with ThreadPoolExecutor(workers, thread_name_prefix="dcpkit-read") as pool:
                futures = [pool.submit(self._guarded, fn, *a, planner) for fn, *a in units]
                for future in futures:
                    future.result()
        return _done()

    def _read_shared(self, items: list[Any], planner: Any, can_share: bool) -> bool:
        """Read with the other ranks, each record once (``shared_read``); False (nothing read)
        when no record is needed by two ranks, or some rank cannot share."""
        self.shared = False
        wants: dict[tuple[str, int, int], int] = {}
        for rel, offset, length, item in items:
            record = (rel, offset, length)
            more = shared_read.wanted(planner, item, length)
            wants[record] = min(length, wants.get(record, 0) + more)
        alone = sum(wants.values())
        plan = shared_read.exchange(can_share, sorted(wants), sorted(self.checksums), alone)
        if plan is None:
            return False
        self.was_shared = True
        share = shared_read.SharedRead(self, plan, items, _load_item, _hash_range)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            share.run(planner, stack)
        self.bytes_read += share.bytes_read
        if share.unavailable:  # the store's failure on some rank's read, not the bytes'
            raise ConnectionError("; ".join(share.unavailable[:3]))
        self.problems += share.problems
        if share.failed and not self.checksums:
            raise ValueError("; ".join(share.failed[:3]))
        self.problems += [Problem("", f"read failed: {m}") for m in share.failed]
        return True

    def join_failed(self) -> None:
        """This rank failed before reading: join the exchange the others wait in, saying so."""
        self.shared = False
        shared_read.exchange(False, [], [])

    @torch.no_grad()  # grad mode is per thread: a DTensor's to_local is then a plain lookup
    def _guarded(self, fn: Any, *args: Any) -> None:
        if not self.checksums:
            fn(*args)
            return
        try:
            fn(*args)
        except (ValueError, OSError) as e:  # reported with the checksum problems
            if transient(e):  # the store's failure, retried by the load: never corruption
                raise
            self.problems.append(Problem("", f"read failed: {e}"))

    def _verify_file(self, name: str, run: list[tuple[str, int, int, Any]], planner: Any) -> None:
        """Load this rank's items of file ``name`` and hash the whole file in the same pass."""
        path = f"{self.path}/{name}"
        h = xxhash.xxh3_64()
        archives: dict[int, TorchSaveFile] = {}
        # ``f`` for the file's small reads (each archive's parse, byte records, the bytes around
        # the tensors); the tensors' bytes through ``raw``, one seek per tensor, no buffer.
        records = [(offset, length) for _, offset, length, _ in run]
        with self.files.open(name, records, True, self.workers) as (f, raw, size):
            with self._count:
                self.bytes_read += size
            if self.files.parse_ahead:
                _open_archives(f, size, run, archives, raw)
            pos, last = 0, -1
            for _, offset, length, item in run:
                again = offset == last  # another part of the record just hashed
                if offset < pos and not again:
                    raise ValueError(f"{path}: records overlap at byte {offset}")
                if not again:
                    _hash_range(f, pos, offset, h)
                try:
                    hashed = None if again else h
                    _load_item(f, size, offset, length, item, planner, archives, hashed)
                except (ValueError, zipfile.BadZipFile) as e:
                    self.problems.append(Problem(name, _named(item, e)))
                    if not again:
                        _hash_range(f, offset, offset + length, h)
                pos, last = max(pos, offset + length), offset
            f.seek(0, os.SEEK_END)
            _hash_range(f, pos, f.tell(), h)
        if h.hexdigest() != self.checksums[name]:
            self.problems.append(
                Problem(name, "checksum mismatch: the file's bytes changed after it was written")
            )

    def _read_run(self, run: list[tuple[str, int, int, Any]], planner: Any) -> None:
        for relative, group in itertools.groupby(run, key=lambda e: e[0]):  # sorted by file
            items = list(group)
            records = [(offset, length) for _, offset, length, _ in items]
            with self._count:
                self.bytes_read += sum(n for _, n in set(records))
            with self.files.open(relative, records, False, self.workers) as (f, _, size):
                archives: dict[int, TorchSaveFile] = {}
                for _, offset, length, item in items:
                    try:
                        _load_item(f, size, offset, length, item, planner, archives, None)
                    except (ValueError, zipfile.BadZipFile) as e:
                        raise CorruptCheckpoint(
                            f"{self.path}/{relative}: {_named(item, e)}"
                        ) from None


class LocalFiles:
    """Opens the data files of a local checkpoint for ``DirectFileSystemReader``: ``open(name,
    records, whole, threads)`` gives ``(f, raw, size)``, a buffered and an unbuffered handle
    and the file's size (``records``: the ``(offset, length)`` the reader will read, in order;
    ``whole``: every byte is read; ``threads``: how many files are read at once)."""

    parse_ahead = True  # every archive of a file read whole is parsed before its data is read

    def __init__(self, folder: Any) -> None:
        self.folder = Path(folder)

    @contextlib.contextmanager
    def open(self, name: str, records: Any, whole: bool, threads: int) -> Any:
        path = self.folder / name
        if whole:
            with open(path, "rb") as f, open(path, "rb", buffering=0) as raw:
                yield f, raw, os.fstat(f.fileno()).st_size
        else:
            with open(path, "rb") as f:
                yield f, f, os.fstat(f.fileno()).st_size


def _named(item: Any, e: BaseException) -> str:
    """``e``'s message, beginning with the key of ``item`` (the rules' messages do already)."""
    fqn = item.storage_index.fqn
    return str(e) if str(e).startswith(f"{fqn}:") else f"{fqn}: {e}"


def _done() -> Future[None]:
    done: Future[None] = Future()
    done.set_result(None)
    return done


def local_regions(template: dict[str, Any]) -> dict[str, list[Region] | None]:
    """What each flattened key of a load's ``template`` needs, as DCP's planner will ask: a
    DTensor its local chunks, a tensor the whole of it, anything else the whole entry."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(template)
    out: dict[str, list[Region] | None] = {}
    for fqn, value in flat.items():
        if hasattr(value, "__create_chunk_list__"):  # a DTensor: its local shard
            out[fqn] = [(list(c.offsets), list(c.sizes)) for c in value.__create_chunk_list__()]
        elif isinstance(value, torch.Tensor):
            out[fqn] = [([0] * value.dim(), list(value.shape))]
        else:
            out[fqn] = None
    return out


def _open_archives(
    f: Any, size: int, run: list[Any], archives: dict[int, TorchSaveFile], raw: Any
) -> None:
    """Parse the archive of each tensor record of ``run`` into ``archives``, before any is read:
    parsing is Python, holding the GIL, and done between hashed reads it kept the other threads
    (each taking the GIL twice per block) waiting. Each archive then reads through ``raw`` (its
    reads loop until they are full). A record that does not parse is left to ``_load_item``,
    which reports it with its item."""
    for _, offset, length, item in run:
        if item.type != LoadItemType.BYTE_IO and offset not in archives and offset + length <= size:
            with contextlib.suppress(ValueError, zipfile.BadZipFile):  # reported when loaded
                archive = archives[offset] = TorchSaveFile(f, offset, length)
                archive.f = raw


def _split(items: list[tuple[str, int, int, Any]], n: int) -> list[list[Any]]:
    """``items`` (sorted by file and offset) cut into at most ``n`` runs of about equal bytes."""
    total = sum(length for _, _, length, _ in items)
    if n <= 1 or total == 0:
        return [items] if items else []
    share = total / n
    runs: list[list[Any]] = [[]]
    acc = 0
    for entry in items:
        if runs[-1] and acc >= share * len(runs) and len(runs) < n:
            runs.append([])
        runs[-1].append(entry)
        acc += entry[2]
    return runs


def _hash_range(f: Any, start: int, stop: int, h: Any) -> None:
    """Feed bytes ``[start, stop)`` of ``f`` to the hash ``h``, read ``HASH_BLOCK`` bytes at a
    time into one buffer."""
    left = stop - start
    if left <= 0:
        return
    f.seek(start)
    buf = memoryview(bytearray(min(left, torchfile.HASH_BLOCK)))
    while left > 0:
        n = f.readinto(buf[: min(left, len(buf))])
        if not n:
            raise ValueError("the file ends before its last record: truncated")
        h.update(buf[:n])
        left -= n


def _load_item(
    f: Any,
    size: int,
    offset: int,
    length: int,
    item: Any,
    planner: Any,
    archives: dict[int, TorchSaveFile],
    h: Any,
) -> None:
    """Load one read item from the record at ``[offset, offset + length)`` of ``f`` (``size``
    bytes long); with a hash ``h``, also feed it every byte of the record, in order (the
    tensor's bytes from where they landed)."""
    fqn = item.storage_index.fqn
    problem = storage_entry_problem(fqn, offset, length, size)
    if problem is not None:
        raise ValueError(problem if problem.startswith(fqn) else f"{fqn}: the file {problem}")
    if item.type == LoadItemType.BYTE_IO:
        f.seek(offset)
        data = f.read(length)
        if len(data) != length:
            raise ValueError("the file ends inside this record: truncated")
        if h is not None:
            h.update(data)
        planner.load_bytes(item, io.BytesIO(data))
        return
    archive = archives.get(offset)
    if archive is None:
        archive = archives[offset] = open_record(f, offset, length, fqn)
    tmd = planner.metadata.state_dict_metadata[fqn]
    chunk = shared_read.chunk_sizes(planner, tmd, fqn).get(tuple(item.storage_index.offset))
    if chunk is None:
        raise ValueError(f"{fqn}: no chunk of .metadata at {list(item.storage_index.offset)}")
    problem = record_problem(archive.obj, fqn, chunk, tmd.properties.dtype)
    if problem is not None:
        raise ValueError(problem)
    target = planner.resolve_tensor(item).detach()
    _fill(archive, item, target, h, (offset, length))
    planner.commit_tensor(item, target)


def _fill(
    archive: TorchSaveFile, item: Any, target: torch.Tensor, h: Any, record: tuple[int, int]
) -> None:
    """Copy the part of the stored tensor that ``item`` asks for into ``target``; with a hash
    ``h``, feed it every byte of the record (``record``: its offset and length in the file) in
    file order, the tensor's bytes as they land when they land in ``target`` whole."""
    ref = archive.obj
    if not isinstance(ref, TensorRef):
        raise ValueError("the stored bytes are not a tensor")
    shape = list(ref.shape)
    offs, lens = list(item.storage_offsets), list(item.lengths)
    if len(offs) != len(shape) or any(o < 0 or o + n > s for o, n, s in zip(offs, lens, shape)):
        raise ValueError(
            f"the plan asks for {lens} at {offs} of a stored {shape} tensor: the checkpoint's "
            "metadata does not match its data"
        )
    if list(target.shape) != lens:
        raise ValueError(f"the destination is {list(target.shape)}, the stored part {lens}")
    rows = (offs[0], offs[0] + lens[0]) if shape else (0, 0)
    direct = (
        bool(shape)
        and offs[1:] == [0] * (len(shape) - 1)
        and lens[1:] == shape[1:]
        and target.device.type == "cpu"
        and target.dtype == ref.dtype
        and target.is_contiguous()
        and ref.is_contiguous()
    )
    start, end = record[0], record[0] + record[1]
    if direct and h is not None:
        span = archive.storage_span(ref, target.numel() * target.element_size(), rows)
        if span is not None:  # hashed as it lands
            _hash_range(archive.f, start, span[0], h)
            archive.read_into(ref, target, rows, h)
            _hash_range(archive.f, span[0] + span[1], end, h)
            return
    if direct:
        archive.read_into(ref, target, rows)
    elif not shape:
        target.copy_(archive.read(ref))
    else:
        part = archive.read(ref, rows)
        for dim in range(1, len(shape)):
            part = part.narrow(dim, offs[dim], lens[dim])
        target.copy_(part)
    if h is not None:  # the bytes did not land in one piece: hash the record as stored
        _hash_range(archive.f, start, end, h)
