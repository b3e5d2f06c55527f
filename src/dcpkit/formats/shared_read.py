"""Replicas read once: a load in which several ranks need the same stored bytes (DDP, HSDP's
replicate dimension, replicated values such as norms and step counts) reads them from storage
once and shares them over the process group.

Every rank says which stored records (``torch.save`` records of the DCP files: file, offset,
length) its plan reads and which files it checksums (one gather of those lists, the only
collective besides the transfers). Each record anyone needs gets one reader: the rank that
checksums its file, which streams that file whole anyway; else, among the ranks that need it,
the one with the fewest bytes assigned so far (largest records first): byte-balanced. The
records are then taken in one global order (file, offset), in batches of at most ``BATCH``
bytes: each rank reads the records it was given, sends each to the ranks that need it
(point-to-point, over the load's process group) and receives the ones it needs, then loads
its items from those bytes. A rank's memory beyond its destination tensors is one batch.

The storage read is then one pass over the checkpoint's records (1x its bytes) whatever the
number of replicas, against R passes when every replica reads for itself; ``bytes_read``
counts what this rank read. A failure while reading is reported after every transfer of the
load has run (a rank never leaves the others waiting): a rank that cannot read a record sends
its bytes anyway, marked, and every rank that needed them reports it.
"""

from __future__ import annotations

import collections
import io
import math
import os
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.planner import LoadItemType

from dcpkit import dist
from dcpkit.errors import transient
from dcpkit.manifest import Problem

BATCH = 256 << 20
SHARE_ABOVE = float(os.environ.get("DCPKIT_SHARE_ABOVE", "0.25"))
UNAVAILABLE = 2  # a buffer's last byte: its reader's store did not answer (1: unreadable)
"""Records are shared when reading them rank by rank would read more than this fraction of the
stored bytes twice (DDP, HSDP: all of them, once per extra replica); below it (FSDP, and a load
at another layout: each rank its own rows, and a few replicated values read by all), each rank
reads what it needs on its own (sending a record between ranks can cost more than reading it
again). ``DCPKIT_SHARE_ABOVE=inf`` never shares (each rank reads all it needs: for a store whose
reads cost less than the process group's transfers)."""
Record = tuple[str, int, int]  # file, offset, length


def exchange(
    can_share: bool, records: list[Record], verifies: list[str], alone: int | None = None
) -> Any:
    """The gather every rank joins once per load (``can_share`` False: this rank failed before
    reading, or reads what cannot be shared): None unless every rank can share and reading rank
    by rank would read more than ``SHARE_ABOVE`` of the records' bytes twice; else the plan
    (``need``: record -> the ranks that need it, ``owner``: record -> the rank that reads it).
    ``alone``: the bytes of ``records`` this rank reads when it reads for itself (its rows of a
    tensor stored whole: a load at another layout; default: all of each)."""
    if alone is None:
        alone = sum(rec[2] for rec in records)
    infos = dist.all_gather_object((can_share, records, verifies, alone))
    if not all(ok for ok, _, _, _ in infos):
        return None
    need: dict[Record, list[int]] = collections.defaultdict(list)
    for rank, (_, recs, _, _) in enumerate(infos):
        for rec in recs:
            need[tuple(rec)].append(rank)  # type: ignore[index]
    distinct = sum(rec[2] for rec in need)  # what sharing reads: each record once, whole
    redundant = sum(alone for _, _, _, alone in infos) - distinct
    if redundant <= SHARE_ABOVE * distinct:  # each rank reads for itself, in parallel threads
        return None
    verifier = {f: rank for rank, (_, _, files, _) in enumerate(infos) for f in files}
    assigned = [0] * len(infos)
    owner: dict[Record, int] = {}
    for rec in sorted(need, key=lambda r: (-r[2], r)):
        if rec[0] in verifier:
            owner[rec] = verifier[rec[0]]
        else:
            owner[rec] = min(need[rec], key=lambda r: (assigned[r], r))
        assigned[owner[rec]] += rec[2]
    return need, owner


def wanted(planner: Any, item: Any, length: int) -> int:
    """About the bytes of its ``length``-byte record that reading ``item`` alone reads: its
    share of the stored chunk's elements (its rows), or the whole record for other values."""
    if item.type == LoadItemType.BYTE_IO:
        return length
    fqn = item.storage_index.fqn
    tmd = planner.metadata.state_dict_metadata.get(fqn)
    chunk = chunk_sizes(planner, tmd, fqn).get(tuple(item.storage_index.offset)) if tmd else None
    whole = math.prod(chunk) if chunk else 0
    return length if whole == 0 else length * math.prod(item.lengths) // whole


def chunk_sizes(planner: Any, tmd: Any, fqn: str) -> dict[tuple[int, ...], list[int]]:
    """The chunks of ``fqn`` (metadata ``tmd``): offsets -> sizes, built once per tensor and
    load (kept on the load's ``planner``; a rank reads many chunks of one tensor)."""
    cache = planner.__dict__.setdefault("_dcpkit_chunk_sizes", {})
    found = cache.get(fqn)
    if found is None:
        found = cache[fqn] = {tuple(c.offsets): list(c.sizes) for c in tmd.chunks}
    return found


def batches(records: list[Record]) -> list[list[Record]]:
    """``records`` (in their global order) cut into runs of at most ``BATCH`` bytes (a larger
    record alone)."""
    out: list[list[Record]] = [[]]
    size = 0
    for rec in records:
        if out[-1] and size + rec[2] > BATCH:
            out.append([])
            size = 0
        out[-1].append(rec)
        size += rec[2]
    return [b for b in out if b]


class SharedRead:
    """One rank's part of a shared load (see the module): ``run`` reads, sends, receives and
    loads; ``problems`` and ``bytes_read`` after it."""

    def __init__(
        self, reader: Any, plan: tuple[Any, Any], items: list[Any], load_item: Any, hash_range: Any
    ) -> None:
        """``load_item(f, size, offset, length, item, planner, archives, hash)`` and
        ``hash_range(f, start, stop, hash)``: the reader's own."""
        self.reader, (self.need, self.owner) = reader, plan
        self.load_item, self.hash_range = load_item, hash_range
        self.me = dist.rank()
        self.items: dict[Record, list[Any]] = collections.defaultdict(list)
        for rel, offset, length, item in items:
            self.items[(rel, offset, length)].append(item)
        self.problems: list[Problem] = []
        self.failed: list[str] = []
        self.unavailable: list[str] = []  # the store's transient failures: retried, not corrupt
        self.bytes_read = 0
        self.hashes: dict[str, list[Any]] = {}  # verified file -> [handle, size, hash, pos]

    def run(self, planner: Any, stack: Any) -> None:
        records = sorted(self.need)
        mine = [r for r in records if self.owner[r] == self.me]
        opened: dict[str, Any] = {}
        names = sorted({r[0] for r in mine} | set(self.reader.checksums))
        for name in names:  # read side by side: they share the rank's parts in flight
            whole = name in self.reader.checksums
            recs = [(r[1], r[2]) for r in mine if r[0] == name]
            try:
                opening = self.reader.files.open(name, recs, whole, len(names))
                f, _, size = stack.enter_context(opening)
            except Exception as e:  # its records go out marked: no rank is left waiting
                self._failed(f"{name}: {e}", e)
                continue
            opened[name] = f
            if whole:
                self.hashes[name] = [f, size, xxhash.xxh3_64(), 0]
        for batch in batches(records):
            self._batch(batch, opened, planner)
        for name, (f, size, h, pos) in self.hashes.items():
            self._hash(f, h, pos, size)
            self.bytes_read += max(0, size - pos)
            if h.hexdigest() != self.reader.checksums[name]:
                why = "checksum mismatch: the file's bytes changed after it was written"
                self.problems.append(Problem(name, why))

    def _batch(self, batch: list[Record], opened: dict[str, Any], planner: Any) -> None:
        import torch.distributed as td

        bufs: dict[Record, torch.Tensor] = {}
        for rec in batch:
            if self.owner[rec] == self.me:
                bufs[rec] = self._read(rec, opened.get(rec[0]))
        ops = []
        for i, rec in enumerate(batch):
            src, needers = self.owner[rec], [r for r in self.need[rec] if r != self.owner[rec]]
            if src == self.me:
                ops += [td.isend(bufs[rec], dst, tag=i) for dst in needers]
            elif self.me in needers:
                bufs[rec] = torch.empty(rec[2] + 1, dtype=torch.uint8)
                ops.append(td.irecv(bufs[rec], src, tag=i))
        for op in ops:
            op.wait()
        for rec in batch:
            if self.me not in self.need[rec]:
                continue
            buf = bufs[rec]
            if int(buf[-1]) == UNAVAILABLE:  # its reader's store did not answer
                self.unavailable.append(f"{rec[0]}: the store did not answer the read at {rec[1]}")
                continue
            if int(buf[-1]):  # its reader could not read it
                self.failed.append(f"{rec[0]}: the bytes at {rec[1]} could not be read")
                continue
            self._load(rec, memoryview(buf.numpy())[:-1], planner)

    def _read(self, rec: Record, f: Any) -> torch.Tensor:
        """Record ``rec`` read into a buffer (one byte longer: set when the read failed); a
        file this rank checksums is hashed up to the record's end on the way."""
        name, offset, length = rec
        buf = torch.zeros(length + 1, dtype=torch.uint8)
        view = memoryview(buf.numpy())[:-1]
        try:
            if f is None:
                raise ValueError("the file could not be opened")
            state = self.hashes.get(name)
            if state is not None:  # the bytes before the record, hashed only
                self.bytes_read += max(0, offset - state[3])
                state[3] = self._hash(f, state[2], state[3], offset)
            f.seek(offset)
            got = 0
            while got < length:
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"the file ends inside the record at {offset}: truncated")
                got += n
            self.bytes_read += length
            if state is not None:
                state[2].update(view)
                state[3] = offset + length
        except Exception as e:  # reported once every transfer has run
            buf[-1] = UNAVAILABLE if self._failed(f"{name}: {e}", e) else 1
        return buf

    def _failed(self, message: str, e: BaseException) -> bool:
        """Records a read that failed: as the store's (``transient``: True) or the file's."""
        if transient(e):
            self.unavailable.append(message)
            return True
        self.failed.append(message)
        return False

    def _hash(self, f: Any, h: Any, start: int, stop: int) -> int:
        if stop > start:
            self.hash_range(f, start, stop, h)
        return max(start, stop)

    def _load(self, rec: Record, data: memoryview, planner: Any) -> None:
        f = io.BytesIO(data)
        archives: dict[int, Any] = {}
        for item in self.items[rec]:
            try:
                self.load_item(f, len(data), 0, len(data), item, planner, archives, None)
            except Exception as e:  # reported once every transfer has run
                self.failed.append(f"{rec[0]}: {item.storage_index.fqn}: {e}")
