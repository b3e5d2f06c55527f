"""One verifier for every store: a checkpoint's manifest (sizes, checksums, seal), its files,
and its format's own structure, with the same message for the same fault wherever it lies.

Sizes and structure come from the store's listing and the checkpoint's metadata; checksums are
computed by the store from the bytes where they are (a remote checkpoint is never downloaded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dcpkit.formats.dcp_index import bound_index
from dcpkit.formats.sources import DCP, HF, detect_kind
from dcpkit.formats.structure import (
    dcp_problems,
    hf_problems,
    index_mismatches,
    index_problems,
    torch_file_problems,
)
from dcpkit.layout import MANIFEST, METADATA, METADATA_INDEX, parse_step
from dcpkit.manifest import CHECKSUM_ALGORITHM, Problem
from dcpkit.progress import progress
from dcpkit.safe_pickle import UnsafeCheckpoint, check_file_name, check_inside


@dataclass
class VerifyReport:
    path: str
    kind: str
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    files_checked: int = 0
    checksummed: bool = False
    summary: str | None = None  # what was checked, for a file with no manifest (torch.save)
    metadata: Any = field(default=None, repr=False)  # DCP's, as parsed for the checks
    index: Any = field(default=None, repr=False)  # the local index of .metadata they read

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(
    store: Any,
    name: str,
    checksums: bool = True,
    checksum_files: list[str] | None = None,
    require_commit: bool = False,
    share: tuple[int, int] | None = None,
) -> VerifyReport:
    """Check checkpoint ``name`` of ``store``: manifest, files and structure.

    ``checksum_files`` limits the checksum pass to those files (ranks split the work on load).
    ``require_commit``: a checkpoint the store does not consider published is a problem (a
    run's own steps), not a note (a checkpoint copied in by hand). ``share``: (rank, world):
    with an index of ``.metadata``, this rank checks the structure of its share of the keys
    from the index, and nothing parses ``.metadata``; without ``share`` the index is compared
    with ``.metadata``, entry by entry.
    """
    # A load's checks by shares read the index of a remote .metadata, never .metadata itself:
    # its view leaves .metadata out (2.8 GiB at 405B and 8192 ranks), its checksum streamed.
    remote_share = share is not None and store.local_dir(name) is None
    read = store.read_manifest(name) if remote_share else None  # read once, checked below
    listed = ((read[0] or {}).get("files") or {}) if read is not None else {}
    lean = isinstance(listed.get(METADATA_INDEX), dict)
    with store.view(name, data=False, metadata=not lean) as view:
        kind = detect_kind(view.path)
        report = VerifyReport(view.location, kind)
        if kind == DCP:
            manifest = _check_manifest(store, name, report, checksums, checksum_files, read)
            try:  # a remote view holds the index whole; its stand-ins have their files' sizes
                index = bound_index(view.path, manifest)
            except UnsafeCheckpoint as e:
                index = None
                report.problems.append(Problem(METADATA_INDEX, str(e)))
            # a remote load leaves records' headers to its reader (no request per record)
            headers = share is None or store.local_dir(name) is not None
            if index is not None and share is not None:
                report.problems += index_problems(
                    view.path, index, *share, opener=view.opener, headers=headers
                )
                report.index = None if lean else index  # a remote view's is gone with the view
            elif lean:  # no index to check by after all: .metadata is needed
                with store.view(name, data=False) as full:
                    _structure(full.path, report, index, full.opener, headers, share is None)
            else:
                _structure(view.path, report, index, view.opener, headers, share is None)
        elif kind == HF:
            folder = name if view.path.is_dir() else ""
            _check_manifest(store, folder, report, checksums, checksum_files)
            report.problems += hf_problems(view.path)
        else:
            problems, checked, unchecked = torch_file_problems(view.path)
            report.problems += problems
            report.summary = f"the CRC-32 of {checked} record(s) match"
            if unchecked and not checked:
                report.summary = (
                    f"none of its {unchecked} record(s) carries a CRC-32 (written without "
                    "them), so nothing could be checksummed"
                )
            elif unchecked:
                report.summary += (
                    f"; {unchecked} record(s) carry no CRC-32 (written without one), so their "
                    "bytes could not be checked"
                )
    reason = store.uncommitted_reason(name)
    if reason is not None:
        if require_commit:
            report.problems.append(Problem("", reason))
        else:
            report.notes.append(reason)
    return report


def _structure(
    folder: Any,
    report: VerifyReport,
    index: Any,
    opener: Any,
    headers: bool = True,
    bounded: bool = False,
) -> None:
    """The structure of the DCP checkpoint in ``folder`` from its ``.metadata`` (kept in
    ``report`` for a load to read by; ``opener`` reads its records), and its index compared with
    it entry by entry. ``bounded``: a verdict alone (no load follows), ``.metadata`` read into
    arrays, one tensor's objects at a time."""
    problems, report.metadata = dcp_problems(folder, opener, headers, bounded)
    report.problems += problems
    damaged = any(p.file == METADATA for p in report.problems)
    if index is not None and report.metadata is not None and not damaged:
        report.problems += index_mismatches(report.metadata, index)


def _check_manifest(
    store: Any,
    folder: str,
    report: VerifyReport,
    checksums: bool,
    names: list[str] | None,
    read: tuple[dict[str, Any] | None, list[Problem]] | None = None,
) -> dict[str, Any] | None:
    """The manifest's checks (``read``: ``store.read_manifest(folder)``, when already done)."""
    manifest, problems = read if read is not None else store.read_manifest(folder)
    report.problems += problems
    linked = store.local_dir(folder) if folder else None
    if linked is not None and linked.is_symlink():
        report.problems.append(
            Problem(
                "",
                f"{folder} is a link to {linked.resolve()}: a step folder is read where it "
                "lies, never through a link (one could stand for any step of any run)",
            )
        )
    if manifest is None:
        earlier = None if problems else _earlier_with_manifest(store, folder)
        if earlier is not None:
            report.problems.append(
                Problem(
                    MANIFEST,
                    f"is missing, while {earlier} before it in the same folder has one: a step "
                    "of a run that writes manifests is refused without its own (its sizes and "
                    "checksums would go unchecked); restore it from a copy",
                )
            )
        elif not problems:
            report.notes.append(
                f"no {MANIFEST}: file checksums cannot be checked (not written by dcpkit); "
                "structure checked only"
            )
        return None
    report.problems += _step_mismatch(store, folder, manifest)
    report.problems += check_files(store, folder, manifest, names, checksums)
    if names is None:
        listed = set(manifest["files"]) | {MANIFEST} | store.own_names
        report.problems += [
            Problem(n, "is not listed in the manifest")
            for n in store.list_names(folder)
            if n not in listed and not _is_dir(store, folder, n)
        ]
    report.files_checked = len(manifest["files"]) if names is None else len(names)
    report.checksummed = checksums
    return manifest


def _earlier_with_manifest(store: Any, folder: str) -> str | None:
    """The nearest of the (up to 4) steps before ``folder``, a ``step-N`` of the same folder,
    that has a manifest (None: none; a folder of checkpoints from others has none, and a run's
    steps from before it took dcpkit on have none)."""
    parent, _, name = folder.rstrip("/").rpartition("/")
    own = parse_step(name)
    if own is None:
        return None
    try:
        names = store.list_names(parent) if parent else store.list_names()
    except Exception:  # the checks of this step's own files report what is unreachable
        return None
    earlier = sorted((s, n) for n in names if (s := parse_step(n)) is not None and s < own)
    for _, other in reversed(earlier[-4:]):
        if store.exists(f"{parent}/{other}/{MANIFEST}" if parent else f"{other}/{MANIFEST}"):
            return other
    return None


def _step_mismatch(store: Any, folder: str, manifest: dict[str, Any]) -> list[Problem]:
    """A ``step-N`` folder whose manifest records another step: renamed, swapped or linked in
    under another step's name (its weights and train state are the manifest's step)."""
    named = parse_step((folder or str(store.root)).rstrip("/").rsplit("/", 1)[-1])
    recorded = manifest.get("step")
    if named is None or type(recorded) is not int or recorded == named:
        return []
    return [
        Problem(
            MANIFEST,
            f"records step {recorded}, but its folder is named step-{named}: a step folder "
            "renamed, swapped or linked under another step's name is refused (its weights and "
            f"train state are step {recorded}'s)",
        )
    ]


def _is_dir(store: Any, folder: str, name: str) -> bool:
    st = store.stat(f"{folder}/{name}" if folder else name)
    return st is not None and st.is_dir


def check_files(
    store: Any,
    folder: str,
    manifest: dict[str, Any],
    names: list[str] | None = None,
    checksums: bool = True,
) -> list[Problem]:
    """Sizes and checksums of the manifest's files (``names``: only these files' checksums)."""
    problems: list[Problem] = []
    files = manifest["files"]
    total = sum(
        e.get("size", 0)
        for n, e in files.items()
        if checksums
        and isinstance(e, dict)
        and isinstance(e.get("size"), int)
        and (names is None or n in names)
    )
    with progress(total, "checksums") as bar:
        for name, expected in files.items():
            problems += _check_file(store, folder, name, expected, names, checksums)
            if isinstance(expected, dict) and isinstance(expected.get("size"), int):
                bar.update(expected["size"] if checksums else 0)
    return problems


def _check_file(
    store: Any,
    folder: str,
    name: str,
    expected: Any,
    names: list[str] | None,
    checksums: bool,
) -> list[Problem]:
    try:
        check_file_name(name, MANIFEST)
    except UnsafeCheckpoint:
        return [Problem(MANIFEST, f"names {name!r}, outside the checkpoint folder")]
    if not isinstance(expected, dict):
        return [Problem(MANIFEST, f"has no size and checksum for {name}")]
    base = store.local_dir(folder)
    if base is not None:
        try:  # a link out: its bytes are another folder's, whatever the manifest says
            check_inside(base, base / name, str(base))
        except UnsafeCheckpoint as e:
            return [Problem(name, str(e))]
    path = f"{folder}/{name}" if folder else name
    st = store.stat(path)
    if st is None or st.is_dir:
        return [Problem(name, "is missing")]
    if st.size != expected.get("size"):
        return [
            Problem(
                name,
                f"has {st.size} bytes, the manifest says {expected.get('size')}: "
                "truncated or replaced",
            )
        ]
    if not checksums or (names is not None and name not in names):
        return []
    if expected.get(CHECKSUM_ALGORITHM) != store.checksum(path):
        return [Problem(name, "checksum mismatch: the file's bytes changed after it was written")]
    return []
