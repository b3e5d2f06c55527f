"""DCP checkpoints read chunk by chunk and written tensor by tensor, without holding the model.

Reading uses DCP's own metadata (``.metadata``: every tensor's global shape, dtype and saved
chunks, and where each chunk's bytes lie) and reads only the chunks, and rows, asked for.
Writing: ``dcp.save`` with a planner that produces each tensor only when the writer asks for
it, splitting tensors above the memory budget into row chunks, as if several ranks saved them.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from dcpkit.dist import quiet_single_process, records_without_crc32
from dcpkit.errors import CorruptCheckpoint, first_failure, out_of_space
from dcpkit.formats import blocks
from dcpkit.formats.metadata_arrays import ArrayMetadata, read_bounded
from dcpkit.formats.rules import check_record, storage_entry_problem
from dcpkit.formats.torchfile import TensorRef, TorchSaveFile
from dcpkit.layout import MANIFEST, METADATA, MODEL, is_model_key
from dcpkit.manifest import HashingFileSystem, parse_manifest
from dcpkit.safe_pickle import UnsafeCheckpoint, check_inside, load_metadata, load_value

Opener = Callable[[Path], Any]
"""Opens a checkpoint file for binary reads (seek, read, readinto); the default is ``open``. A
metadata-only local copy of a remote checkpoint passes one that reads the remote original."""


def open_local(path: Path) -> Any:
    return open(path, "rb")


class NotACheckpoint(ValueError):
    """The path is not a readable DCP checkpoint."""


class DCPCheckpoint:
    """Read access to one DCP checkpoint folder (``.metadata`` + ``*.distcp``)."""

    def __init__(
        self, path: str | Path, opener: Opener | None = None, bounded: bool = False
    ) -> None:
        """``bounded``: ``.metadata`` read into arrays (``formats.metadata_arrays``), each
        tensor's entry built when asked: for tools that look at a checkpoint without loading
        it, in memory a small multiple of its chunks' integers."""
        self.path = Path(path)
        self._open = opener or open_local
        if not self.path.exists():
            raise FileNotFoundError(f"{self.path} does not exist")
        if not self.path.is_dir():
            raise NotACheckpoint(
                f"{self.path} is not a folder; a DCP checkpoint is a step-N folder"
            )
        if not (self.path / METADATA).is_file():
            raise NotACheckpoint(
                f"{self.path} is not a DCP checkpoint: it has no {METADATA} (an interrupted save, "
                "or a folder that holds checkpoints: pass one step-N folder)"
            )
        try:
            with open(self.path / METADATA, "rb") as f:
                read = read_bounded if bounded else load_metadata
                self.metadata = read(f, str(self.path / METADATA))
        except UnsafeCheckpoint as e:
            raise NotACheckpoint(str(e)) from None
        self.tensors: Mapping[str, TensorStorageMetadata] = {}
        self.objects: list[str] = []
        arrays = isinstance(self.metadata, ArrayMetadata)
        if arrays:
            self.tensors = self.metadata.state_dict_metadata.tensors()
            self.objects = self.metadata.state_dict_metadata.objects()
        for fqn, md in {} if arrays else self.metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                self.tensors[fqn] = md
            elif isinstance(md, BytesStorageMetadata):
                self.objects.append(fqn)
        self._files: dict[str, Any] = {}
        self._checked: set[str] = set()
        self.groups = _manifest_groups(self.path)
        """The state groups besides the model that the manifest lists (user states included)."""

    def is_model_key(self, key: str) -> bool:
        """A model parameter: not optimizer, scheduler, ..., nor a state the manifest lists."""
        return is_model_key(key, self.groups)

    # -- description

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self.tensors[fqn].size)

    def dtype(self, fqn: str) -> torch.dtype:
        return self.tensors[fqn].properties.dtype

    def nbytes(self, fqn: str) -> int:
        md = self.tensors[fqn]
        n = md.properties.dtype.itemsize
        for s in md.size:
            n *= s
        return n

    def path_of(self, fqn: str) -> tuple[str | int, ...]:
        """The nested path DCP flattened into ``fqn`` (ints index lists), for rebuilding."""
        mapping = self.metadata.planner_data or {}
        path = mapping.get(fqn)
        return tuple(path) if path else tuple(fqn.split("."))

    # -- reading

    def _file(self, relative: str):  # type: ignore[no-untyped-def]
        f = self._files.get(relative)
        if f is None:
            full = self.path / relative
            if not full.is_file():
                raise NotACheckpoint(
                    f"{self.path} is incomplete: {relative}, named in {METADATA}, is missing"
                )
            check_inside(self.path, full, str(self.path))
            f = self._files[relative] = self._open(full)
        return f

    def _storage(self, fqn: str, offsets: Any):  # type: ignore[no-untyped-def]
        info = self.metadata.storage_data[MetadataIndex(fqn, offsets)]
        if getattr(info, "transform_descriptors", None):
            raise NotACheckpoint(
                f"{fqn} is stored with transforms {info.transform_descriptors} (e.g. compression), "
                "which dcpkit does not read"
            )
        return self._file(info.relative_path), info.offset, info.length

    def _check_claims(self, fqn: str) -> None:
        """What ``.metadata`` says of a tensor must fit the bytes really there: no tensor larger
        than its stored chunks, no chunk past the end of its file (a hostile file would
        otherwise make a read allocate anything it names)."""
        md = self.tensors[fqn]
        where = self.path / METADATA
        if any(int(s) < 0 for s in md.size):
            raise CorruptCheckpoint(f"{where}: {fqn}: negative size {list(md.size)}")
        stored = 0
        for chunk in md.chunks:
            info = self.metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise CorruptCheckpoint(
                    f"{where}: {fqn}: chunk at {list(chunk.offsets)} has no storage"
                )
            path = self.path / info.relative_path
            size = path.stat().st_size if path.is_file() else None
            problem = storage_entry_problem(fqn, info.offset, info.length, size)
            if problem is not None:
                raise CorruptCheckpoint(f"{path}: {problem}")
            stored += info.length
        total = md.properties.dtype.itemsize * math.prod(int(s) for s in md.size)
        if total > stored:
            raise CorruptCheckpoint(
                f"{where}: {fqn}: claims {total} bytes ({list(md.size)}) but its records hold "
                f"{stored}: refused (a corrupt or hostile checkpoint)"
            )

    def check(self, fqns: list[str] | None = None) -> None:
        """Refuse, before anything is allocated or written, tensors whose metadata claims more
        than the files hold (every tensor, or ``fqns``)."""
        for fqn in self.tensors if fqns is None else fqns:
            if fqn not in self._checked:
                self._check_claims(fqn)
                self._checked.add(fqn)

    def _chunk(self, fqn: str, chunk: Any) -> tuple[TorchSaveFile, TensorRef]:
        """The stored chunk of ``fqn`` at ``chunk.offsets``: a tensor of the dtype and shape the
        metadata gives it, or an error naming the file."""
        f, start, length = self._storage(fqn, chunk.offsets)
        md = self.tensors[fqn]
        try:
            archive = check_record(f, start, length, fqn, chunk.sizes, md.properties.dtype)
        except ValueError as e:
            info = self.metadata.storage_data[MetadataIndex(fqn, chunk.offsets)]
            raise CorruptCheckpoint(f"{self.path / info.relative_path}: {e}") from None
        ref = archive.obj
        return archive, ref

    def read(self, fqn: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The whole tensor, or rows ``[start, stop)`` of its first dimension."""
        self.check([fqn])
        md = self.tensors[fqn]
        shape = list(md.size)
        if rows is not None:
            shape[0] = rows[1] - rows[0]
        # The rows asked for (all of them by default) inside one chunk that spans the other
        # dimensions: return what is read, without assembling a second copy.
        span = rows if rows is not None or not md.size else (0, md.size[0])
        for chunk in md.chunks:
            o, z = list(chunk.offsets), list(chunk.sizes)
            if o[1:] != [0] * len(o[1:]) or z[1:] != list(md.size)[1:]:
                continue
            if span is None or (o[0] <= span[0] and span[1] <= o[0] + z[0]):
                archive, ref = self._chunk(fqn, chunk)
                local = None if span is None else (span[0] - o[0], span[1] - o[0])
                return archive.read(ref, local).view(shape)
        out = blocks.empty(shape, md.properties.dtype)  # each row block assembled here
        for chunk in md.chunks:
            offsets, sizes = list(chunk.offsets), list(chunk.sizes)
            local_rows = None
            if rows is not None:
                lo, hi = max(rows[0], offsets[0]), min(rows[1], offsets[0] + sizes[0])
                if lo >= hi:
                    continue
                local_rows = (lo - offsets[0], hi - offsets[0])
                offsets[0], sizes[0] = lo - rows[0], hi - lo
            archive, ref = self._chunk(fqn, chunk)
            piece = archive.read(ref, local_rows)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            out[index] = piece.view(sizes) if piece.dim() != len(sizes) else piece
        return out

    def read_object(self, fqn: str) -> Any:
        """A non-tensor value (stored by DCP as a ``torch.save`` of the object)."""
        f, start, length = self._storage(fqn, None)
        f.seek(start)
        data = f.read(length)
        if len(data) != length:
            raise NotACheckpoint(f"{self.path} is truncated: the value {fqn} is cut short")
        return load_value(data, f"{self.path}: the value {fqn}")

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> DCPCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- writing -------------------------------------------------------------------------------------

Producer = Callable[[str, "tuple[int, int] | None"], torch.Tensor]


class _LazySavePlanner(DefaultSavePlanner):
    """Plans from meta tensors; ``resolve_data`` produces each tensor (or row chunk) on demand."""

    def __init__(
        self,
        produce: Producer,
        max_chunk_bytes: int,
        on_written: Callable[[int], None],
        row_block: dict[str, int],
    ) -> None:
        super().__init__(dedup_save_to_lowest_rank=False)
        self._produce = produce
        self._max_chunk_bytes = max_chunk_bytes
        self._on_written = on_written
        self._row_block = row_block

    def create_local_plan(self):  # type: ignore[no-untyped-def]
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            items.extend(self._split(item))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _split(self, item: WriteItem) -> list[WriteItem]:
        td = item.tensor_data
        if item.type == WriteItemType.BYTE_IO or td is None or len(td.size) == 0:
            return [item]
        nbytes = td.properties.dtype.itemsize
        for s in td.size:
            nbytes *= s
        rows = td.size[0]
        if nbytes <= self._max_chunk_bytes or rows <= 1:
            return [item]
        row_bytes = nbytes // rows
        block = self._row_block.get(item.index.fqn, 1)
        step = max(block, (self._max_chunk_bytes // row_bytes) // block * block)
        out = []
        for start in range(0, rows, step):
            n = min(step, rows - start)
            offsets = torch.Size([start] + [0] * (len(td.size) - 1))
            sizes = torch.Size([n, *td.size[1:]])
            out.append(
                WriteItem(
                    index=MetadataIndex(item.index.fqn, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=dataclasses.replace(
                        td, chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes)
                    ),
                )
            )
        return out

    def resolve_data(self, write_item: WriteItem):  # type: ignore[no-untyped-def]
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.lookup_object(write_item.index), buf)
            buf.seek(0)
            return buf
        td = write_item.tensor_data
        rows = None
        if write_item.type == WriteItemType.SHARD and len(td.size):
            start = td.chunk.offsets[0]
            if td.chunk.sizes[0] != td.size[0]:
                rows = (start, start + td.chunk.sizes[0])
        tensor = self._produce(fqn, rows).to(td.properties.dtype).contiguous()
        self._on_written(tensor.numel() * tensor.element_size())
        return tensor


_MANIFEST_MAX = 64 << 20


def _manifest_groups(folder: Path) -> frozenset[str]:
    """Non-model groups named by the folder's manifest (none without a usable manifest)."""
    path = folder / MANIFEST
    try:
        if not path.is_file() or path.stat().st_size > _MANIFEST_MAX:
            return frozenset()
        manifest, problems = parse_manifest(path.read_bytes())
    except OSError:
        return frozenset()
    groups = (manifest or {}).get("groups") if not problems else None
    if not isinstance(groups, list):
        return frozenset()
    return frozenset(g for g in groups if isinstance(g, str) and g != MODEL)


def write_dcp(
    path: Path,
    state: dict[str, Any],
    produce: Producer,
    max_chunk_bytes: int = 256 << 20,
    on_written: Callable[[int], None] = lambda n: None,
    row_block: dict[str, int] | None = None,
    digests: dict[str, tuple[str, int]] | None = None,
) -> None:
    """Write a DCP checkpoint (one process) whose tensors come from ``produce(fqn, rows)``.

    ``state`` is the (possibly nested) state dict with meta tensors standing for the real ones
    and plain values for the rest; ``fqn`` is DCP's dotted key. ``row_block[fqn]`` keeps row
    chunks a multiple of that many rows (for row-block transforms). ``digests`` receives each
    file's checksum as it is written (name -> (xxh3-64, size)): no reading back."""
    planner = _LazySavePlanner(produce, max_chunk_bytes, on_written, row_block or {})
    with quiet_single_process():
        # One file per tensor chunk: DCP's writer keeps every tensor of a file referenced until
        # that file is done, so one file per rank would hold the whole model in memory.
        writer = FileSystemWriter(str(path), single_file_per_rank=False)
        if digests is not None:
            writer.fs = HashingFileSystem(digests)
        try:
            with records_without_crc32(writer.fs):  # the manifest's checksums cover the bytes
                dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:  # a BaseException wrapping what was raised inside
            raise out_of_space(first_failure(e), path) from None


def meta_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def nest(flat: dict[tuple[str | int, ...], Any]) -> dict[str, Any]:
    """``{("a", "b"): v, ("a", "c", 0): w}`` -> ``{"a": {"b": v, "c": [w]}}`` (int path parts
    index lists, as DCP's own unflattening does)."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node: Any = out
        for part, nxt in itertools.pairwise(path):
            empty: Any = [] if isinstance(nxt, int) else {}
            if isinstance(node, list):
                while len(node) <= part:
                    node.append(None)
                if node[part] is None:
                    node[part] = empty
                node = node[part]
            else:
                node = node.setdefault(part, empty)
        last = path[-1]
        if isinstance(node, list):
            while len(node) <= last:
                node.append(None)
        node[last] = value
    return out
