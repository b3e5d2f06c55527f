"""What a checkpoint's own format says must hold: DCP chunks tile every tensor and point into
files long enough; a Hugging Face index and its shards agree; a ``torch.save`` archive passes
its CRC-32 checks. Read from metadata and headers only (except the archive)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from dcpkit.formats.chunks import chunk_problems
from dcpkit.formats.dcp import DCPCheckpoint, NotACheckpoint, open_local
from dcpkit.formats.dcp_index import Box, DcpIndex
from dcpkit.formats.rules import check_record, storage_entry_problem, transform_problem
from dcpkit.formats.safetensors import read_header
from dcpkit.layout import HF_INDEX, MANIFEST, METADATA, METADATA_INDEX
from dcpkit.manifest import Problem
from dcpkit.safe_pickle import UnsafeCheckpoint


def dcp_problems(
    folder: Path, opener: Any = None, headers: bool = True, bounded: bool = False
) -> tuple[list[Problem], Any]:
    """The structure's problems, and the ``Metadata`` parsed to find them (None when it could
    not be parsed), for a load that follows to read by instead of parsing it again.
    ``opener``: opens the data files (``CheckpointView.opener``; local files by default), whose
    records' headers are checked against ``.metadata`` as every reader checks them (unless not
    ``headers``: left to a reader that checks each as it reads it). ``bounded``: ``.metadata``
    read into arrays (``formats.metadata_arrays``), for a verdict that keeps nothing of it."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from dcpkit.dist import paused_gc

    problems: list[Problem] = []
    try:
        ckpt = DCPCheckpoint(folder, bounded=bounded)
    except NotACheckpoint as e:
        return [Problem(METADATA, str(e))], None
    with ckpt:
        md = ckpt.metadata
        problems += metadata_problems(md)
        sizes = _file_sizes(folder)
        stored = md.storage_data or {}
        with RecordChecks(folder, sizes, opener, headers) as records, paused_gc():
            for fqn, tmd in md.state_dict_metadata.items():
                if not isinstance(tmd, TensorStorageMetadata):
                    entries = [(stored.get(MetadataIndex(fqn, None)), None)]
                elif any(int(s) < 0 for s in tmd.size):
                    continue  # its own problem above
                else:
                    entries = [(stored.get(MetadataIndex(fqn, c.offsets)), c) for c in tmd.chunks]
                for info, chunk in entries:
                    if info is None:  # its own problem above
                        continue
                    problems += records.check(
                        fqn,
                        info.relative_path,
                        info.offset,
                        info.length,
                        None if chunk is None else list(chunk.sizes),
                        tmd.properties.dtype if chunk is not None else None,
                        getattr(info, "transform_descriptors", None),
                    )
    return problems, md


def refuse_broken(view: Any) -> None:
    """Refuse a DCP checkpoint (a ``CheckpointView``) whose structure breaks a rule - the checks
    ``verify`` and a load run - before a tool reads or writes anything from it: its tensors are
    not what its ``.metadata`` says. Other formats pass (their readers check as they read)."""
    from dcpkit.errors import CorruptCheckpoint
    from dcpkit.formats.sources import DCP, detect_kind

    if detect_kind(view.path) != DCP:
        return
    problems, _ = dcp_problems(view.path, view.opener, bounded=True)
    if problems:
        more = len(problems) - 1
        tail = f" (and {more} more: `dcpkit verify` lists them)" if more else ""
        raise CorruptCheckpoint(f"{view.location}/{problems[0]}{tail}")


def _file_sizes(folder: Path) -> dict[str, int]:
    return {e.name: e.stat().st_size for e in folder.iterdir() if e.is_file()}


class RecordChecks:
    """The rules of ``formats.rules`` applied to storage entries of the checkpoint in ``folder``
    (``sizes``: its files' sizes), each file opened once through ``opener``."""

    def __init__(
        self, folder: Path, sizes: dict[str, int], opener: Any = None, headers: bool = True
    ) -> None:
        self.folder, self.sizes, self.headers = folder, sizes, headers
        self.opener = opener or open_local
        self.files: dict[str, Any] = {}

    def __enter__(self) -> RecordChecks:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()

    def check(
        self,
        fqn: str,
        name: str,
        offset: int,
        length: int,
        sizes: list[int] | None,
        dtype: Any,
        transforms: Any = None,
    ) -> list[Problem]:
        """The problems of ``fqn``'s storage entry (``length`` bytes at ``offset`` of file
        ``name``, stored with the DCP ``transforms`` named) and, for a tensor's chunk of shape
        ``sizes``, of the record there."""
        problem = storage_entry_problem(fqn, offset, length, self.sizes.get(name))
        if problem is None:
            problem = transform_problem(fqn, name, transforms, MANIFEST in self.sizes)
        if problem is not None:
            return [Problem(name, problem)]
        if sizes is None or transforms or not self.headers:  # a value (parsed when read),
            return []  # compressed bytes, or a reader that checks each header as it reads
        try:
            f = self.files.get(name)
            if f is None:
                f = self.files[name] = self.opener(self.folder / name)
            check_record(f, offset, length, fqn, sizes, dtype)
        except ValueError as e:
            return [Problem(name, str(e))]
        return []


def index_problems(
    folder: Path,
    index: DcpIndex,
    rank: int = 0,
    world: int = 1,
    opener: Any = None,
    headers: bool = True,
) -> list[Problem]:
    """What ``dcp_problems`` checks, read from the index of ``.metadata`` instead, for the keys
    ``rank`` checks of ``world`` (each key by one rank): a load's ranks share the checks, and
    none parses the whole ``.metadata``. ``opener``: as for ``dcp_problems``; without
    ``headers`` the records' headers are left to the reader, which checks each by the same rule
    as it reads it (a remote load: no request per record before the reads)."""
    problems: list[Problem] = []
    sizes = _file_sizes(folder)
    with index.mapped(), RecordChecks(folder, sizes, opener, headers) as records:
        for fqn in list(index.keys())[rank::world]:
            e = index.entries[fqn]
            try:
                rows = [([], None, e["b"])] if "b" in e else index.rows(fqn)
            except UnsafeCheckpoint as err:
                problems.append(Problem(METADATA_INDEX, str(err)))
                continue
            if "b" not in e:
                boxes = [Box(o, k) for o, k, _ in rows]
                found = chunk_problems(fqn, e["size"], boxes, first=True)
                problems += [Problem(METADATA, p) for p in found]
            for _, chunk_sizes, (f, offset, length) in rows:
                name = index.files[f]
                problems += records.check(fqn, name, offset, length, chunk_sizes, e.get("dtype"))
    return problems


def index_mismatches(md: Any, index: DcpIndex) -> list[Problem]:
    """Where the index says otherwise than ``.metadata`` (``md``), entry by entry."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from dcpkit.dist import paused_gc

    problems: list[Problem] = []
    stored = md.storage_data or {}

    def differs(fqn: str, why: str) -> None:
        problems.append(Problem(METADATA_INDEX, f"{fqn}: {why}, unlike {METADATA}"))

    with paused_gc(), index.mapped():
        for fqn in set(index.keys()) - set(md.state_dict_metadata):
            differs(fqn, "an entry")
        for fqn, tmd in md.state_dict_metadata.items():
            e = index.entries.get(fqn)
            if e is None or ("b" in e) == isinstance(tmd, TensorStorageMetadata):
                differs(fqn, "no entry" if e is None else "another kind of entry")
                continue
            if "b" in e:
                info = stored.get(MetadataIndex(fqn, None))
                f, offset, length = e["b"]
                if info is None or (info.relative_path, info.offset, info.length) != (
                    index.files[f],
                    offset,
                    length,
                ):
                    differs(fqn, "another storage entry")
                continue
            if (e["size"], e["dtype"], e["grad"]) != (
                list(tmd.size),
                tmd.properties.dtype,
                bool(tmd.properties.requires_grad),
            ):
                differs(fqn, f"shape {e['size']}, dtype {e['dtype']}")
                continue
            try:
                rows = index.rows(fqn)
            except UnsafeCheckpoint as err:
                problems.append(Problem(METADATA_INDEX, str(err)))
                continue
            mine = {(tuple(o), tuple(k), index.files[f], a, n) for o, k, (f, a, n) in rows}
            theirs = set()
            for c in tmd.chunks:
                info = stored.get(MetadataIndex(fqn, c.offsets))
                where = (info.relative_path, info.offset, info.length) if info else None
                theirs.add((tuple(c.offsets), tuple(c.sizes), *(where or (None, None, None))))
            if mine != theirs or len(rows) != len(tmd.chunks):
                differs(fqn, f"{len(rows)} chunks (or their storage) differ from its own")
    return problems


def metadata_problems(md: Any) -> list[Problem]:
    """What ``.metadata`` says that cannot hold: a tensor's chunks not tiling it, a chunk or a
    value without storage. With the cyclic garbage collector paused: at scale these are
    millions of small objects, none in a cycle (8B over 512 ranks: 5.9 s with collections)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    from dcpkit.dist import paused_gc

    problems: list[Problem] = []
    stored = md.storage_data or {}
    with paused_gc():
        for fqn, tmd in md.state_dict_metadata.items():
            if not isinstance(tmd, TensorStorageMetadata):
                if MetadataIndex(fqn, None) not in stored:
                    problems.append(Problem(METADATA, f"{fqn}: value has no storage"))
                continue
            if any(int(s) < 0 for s in tmd.size):
                problems.append(Problem(METADATA, f"{fqn}: negative size {list(tmd.size)}"))
                continue
            found = chunk_problems(fqn, tmd.size, tmd.chunks, first=True)
            problems += [Problem(METADATA, p) for p in found]
            for chunk in tmd.chunks:
                if MetadataIndex(fqn, chunk.offsets) not in stored:
                    problems.append(
                        Problem(METADATA, f"{fqn}: chunk at {list(chunk.offsets)} has no storage")
                    )
    return problems


def hf_problems(path: Path) -> list[Problem]:
    problems: list[Problem] = []
    folder = path if path.is_dir() else path.parent
    files = [path] if path.is_file() else sorted(folder.glob("*.safetensors"))
    names: dict[str, str] = {}
    for f in files:
        try:
            header, _ = read_header(f)
        except (ValueError, OSError) as e:
            problems.append(Problem(f.name, str(e).replace(str(f), "").strip() or "bad"))
            continue
        for key in header:
            if key != "__metadata__":
                names[key] = f.name
    index_path = folder / HF_INDEX
    if path.is_dir() and index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            return [*problems, Problem(HF_INDEX, f"cannot be parsed ({e})")]
        for key, file in weight_map.items():
            if names.get(key) != file:
                problems.append(Problem(HF_INDEX, f"maps {key} to {file}, which does not hold it"))
        for key, file in names.items():
            if key not in weight_map:
                problems.append(Problem(file, f"holds {key}, which {HF_INDEX} omits"))
    return problems


def torch_file_problems(path: Path) -> tuple[list[Problem], int, int]:
    """A ``torch.save`` archive: every record read and checked against its CRC-32. Returns the
    problems, the records checked and the records that carry no CRC-32 (written with
    ``torch.serialization.set_crc32_options(False)``, or laid out and filled in afterwards):
    there is nothing to check those against, and the caller must say so."""
    checked = unchecked = 0
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.CRC == 0 and info.file_size:
                    unchecked += 1
                    continue
                try:
                    with zf.open(info) as r:
                        while r.read(1 << 20):
                            pass
                except zipfile.BadZipFile:
                    problem = Problem(path.name, f"record {info.filename} fails its CRC-32 check")
                    return [problem], checked, unchecked
                checked += 1
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        return [Problem(path.name, f"is not a readable torch.save archive ({e})")], 0, 0
    return [], checked, unchecked
