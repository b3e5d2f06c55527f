"""What a checkpoint's own format says must hold: DCP chunks tile every tensor and point into
files long enough; a Hugging Face index and its shards agree; a ``torch.save`` archive passes
its CRC-32 checks. Read from metadata and headers only (except the archive)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

from dcpkit.formats.dcp import DCPCheckpoint, NotACheckpoint
from dcpkit.formats.safetensors import read_header
from dcpkit.layout import HF_INDEX, METADATA
from dcpkit.manifest import Problem


def dcp_problems(folder: Path) -> list[Problem]:
    problems: list[Problem] = []
    try:
        ckpt = DCPCheckpoint(folder)
    except NotACheckpoint as e:
        return [Problem(METADATA, str(e))]
    with ckpt:
        md = ckpt.metadata
        sizes: dict[str, int] = {}
        for entry in folder.iterdir():
            if entry.is_file():
                sizes[entry.name] = entry.stat().st_size
        referenced: set[str] = set()
        for index, info in md.storage_data.items():
            referenced.add(info.relative_path)
            size = sizes.get(info.relative_path)
            if size is None:
                problems.append(Problem(info.relative_path, f"is missing (it holds {index.fqn})"))
            elif info.offset + info.length > size:
                problems.append(
                    Problem(
                        info.relative_path,
                        f"is {size} bytes, too short for {index.fqn} (ends at byte "
                        f"{info.offset + info.length}): truncated",
                    )
                )
        for fqn, tmd in ckpt.tensors.items():
            problem = _coverage_problem(fqn, tmd)
            if problem:
                problems.append(Problem(METADATA, problem))
            for chunk in tmd.chunks:
                if not _has_storage(md, fqn, chunk.offsets):
                    problems.append(
                        Problem(METADATA, f"{fqn}: chunk at {list(chunk.offsets)} has no storage")
                    )
        for fqn in ckpt.objects:
            if not _has_storage(md, fqn, None):
                problems.append(Problem(METADATA, f"{fqn}: value has no storage"))
    return problems


def _has_storage(md: Any, fqn: str, offsets: Any) -> bool:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(fqn, offsets) in md.storage_data


def _coverage_problem(fqn: str, tmd: Any) -> str | None:
    """The chunks of a tensor must tile its global shape: in bounds, no overlap, no gap."""
    shape = list(tmd.size)
    total = 1
    for s in shape:
        total *= s
    covered = 0
    boxes = []
    for chunk in tmd.chunks:
        off, size = list(chunk.offsets), list(chunk.sizes)
        if any(o < 0 or o + n > s for o, n, s in zip(off, size, shape)):
            return f"{fqn}: chunk at {off} of size {size} lies outside the shape {shape}"
        vol = 1
        for n in size:
            vol *= n
        covered += vol
        boxes.append((off, size))
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if all(
                ao < bo + bs and bo < ao + as_
                for ao, as_, bo, bs in zip(a_off, a_size, b_off, b_size)
            ):
                return f"{fqn}: chunks at {a_off} and {b_off} overlap"
    if covered != total:
        return f"{fqn}: chunks cover {covered} of {total} elements"
    return None


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


def torch_file_problems(path: Path) -> list[Problem]:
    """A ``torch.save`` archive: every record read and checked against its CRC-32 (a record
    written without one, by ``torch.serialization.set_crc32_options(False)``, is not: there is
    nothing to check it against)."""
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.CRC == 0 and info.file_size:
                    continue
                try:
                    with zf.open(info) as r:
                        while r.read(1 << 20):
                            pass
                except zipfile.BadZipFile:
                    return [Problem(path.name, f"record {info.filename} fails its CRC-32 check")]
    except (zipfile.BadZipFile, EOFError, OSError) as e:
        return [Problem(path.name, f"is not a readable torch.save archive ({e})")]
    return []
