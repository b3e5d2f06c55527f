"""``dcpkit verify``: prove a checkpoint intact, or list every problem with the file it is in."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcpkit import layout
from dcpkit.convert.dcpio import DCPCheckpoint, NotACheckpoint
from dcpkit.convert.safetensors_io import INDEX, read_header
from dcpkit.integrity import Problem, check_files, load_manifest, unlisted_files
from dcpkit.sources import DCP, HF, detect_kind


@dataclass
class VerifyReport:
    path: Path
    kind: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files_checked: int = 0
    checksummed: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_path(
    path: str | Path,
    checksums: bool = True,
    checksum_files: list[str] | None = None,
    checksum_of: Callable[[str], str] | None = None,
) -> VerifyReport:
    """Check a checkpoint: manifest checksums and sizes, and the format's own structure.

    ``checksum_files`` limits the checksum pass to those files (ranks split the work on load).
    ``checksum_of`` takes a file name and computes its checksum from another copy of the bytes
    (the remote original of a metadata-only local copy).
    """
    p = Path(path)
    kind = detect_kind(p)
    report = VerifyReport(p, kind)
    if kind == DCP:
        _verify_manifest(p, report, checksums, checksum_files, checksum_of)
        _verify_dcp_structure(p, report)
    elif kind == HF:
        folder = p if p.is_dir() else p.parent
        _verify_manifest(folder, report, checksums, checksum_files, checksum_of)
        _verify_hf_structure(p, report)
    else:
        _verify_torch_file(p, report)
    return report


def _verify_manifest(
    folder: Path,
    report: VerifyReport,
    checksums: bool,
    names: list[str] | None,
    checksum_of: Callable[[str], str] | None = None,
) -> None:
    manifest, problems = load_manifest(folder)
    report.problems += problems
    if manifest is None:
        if not problems:
            report.notes.append(
                f"no {layout.MANIFEST}: file checksums cannot be checked (not "
                "written by dcpkit); structure checked only"
            )
        return
    report.problems += check_files(folder, manifest, names, checksums, checksum_of)
    if names is None:
        report.problems += unlisted_files(folder, manifest)
    report.files_checked = len(manifest["files"]) if names is None else len(names)
    report.checksummed = checksums


def _verify_dcp_structure(folder: Path, report: VerifyReport) -> None:
    try:
        ckpt = DCPCheckpoint(folder)
    except NotACheckpoint as e:
        report.problems.append(Problem(layout.METADATA, str(e)))
        return
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
                report.problems.append(
                    Problem(info.relative_path, f"is missing (it holds {index.fqn})")
                )
            elif info.offset + info.length > size:
                report.problems.append(
                    Problem(
                        info.relative_path,
                        f"is {size} bytes, too short for {index.fqn} (ends at byte "
                        f"{info.offset + info.length}): truncated",
                    )
                )
        for fqn, tmd in ckpt.tensors.items():
            problem = _coverage_problem(fqn, tmd)
            if problem:
                report.problems.append(Problem(layout.METADATA, problem))
            for chunk in tmd.chunks:
                if not _has_storage(md, fqn, chunk.offsets):
                    report.problems.append(
                        Problem(
                            layout.METADATA, f"{fqn}: chunk at {list(chunk.offsets)} has no storage"
                        )
                    )
        for fqn in ckpt.objects:
            if not _has_storage(md, fqn, None):
                report.problems.append(Problem(layout.METADATA, f"{fqn}: value has no storage"))


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


def _verify_hf_structure(path: Path, report: VerifyReport) -> None:
    import json

    folder = path if path.is_dir() else path.parent
    files = [path] if path.is_file() else sorted(folder.glob("*.safetensors"))
    names: dict[str, str] = {}
    for f in files:
        try:
            header, _ = read_header(f)
        except (ValueError, OSError) as e:
            report.problems.append(Problem(f.name, str(e).replace(str(f), "").strip() or "bad"))
            continue
        for key in header:
            if key != "__metadata__":
                names[key] = f.name
    index_path = folder / INDEX
    if path.is_dir() and index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            report.problems.append(Problem(INDEX, f"cannot be parsed ({e})"))
            return
        for key, file in weight_map.items():
            if names.get(key) != file:
                report.problems.append(
                    Problem(INDEX, f"maps {key} to {file}, which does not hold it")
                )
        for key, file in names.items():
            if key not in weight_map:
                report.problems.append(Problem(file, f"holds {key}, which {INDEX} omits"))


def _verify_torch_file(path: Path, report: VerifyReport) -> None:
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()  # reads every record and checks its CRC-32
    except zipfile.BadZipFile as e:
        report.problems.append(Problem(path.name, f"is not a readable torch.save archive ({e})"))
        return
    if bad is not None:
        report.problems.append(Problem(path.name, f"record {bad} fails its CRC-32 check"))
    report.checksummed = True
    report.files_checked = 1
