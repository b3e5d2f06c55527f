"""``dcpkit verify``: prove a checkpoint intact, or list every problem with the file it is in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dcpkit.integrity import VerifyReport, verify_checkpoint
from dcpkit.readers import reading


def verify_path(
    path: str | Path,
    checksums: bool = True,
    storage_options: dict[str, Any] | None = None,
    step: int | str | None = None,
) -> VerifyReport:
    """Check the checkpoint at ``path`` (a folder, a file or a URL; or a checkpoint folder with
    ``step``, a number or ``latest``): manifest sizes and checksums, and the format's own
    structure. A remote checkpoint is checked in place; a step is held against retention."""
    with reading(path, step, "verify", storage_options) as held:
        report = verify_checkpoint(held.store, held.name, checksums=checksums)
        report.notes[:0] = held.notes
        return report


def report_lines(report: VerifyReport) -> list[str]:
    """What ``dcpkit verify`` prints."""
    lines = [f"note: {note}" for note in report.notes]
    if report.ok:
        what = "sizes and checksums" if report.checksummed else "sizes"
        checked = (
            report.summary or f"{what} of {report.files_checked} file(s) match"
            if report.files_checked or report.summary
            else "no manifest, so no file sizes or checksums to compare"
        )
        lines.append(f"OK: {report.path} ({report.kind}): structure intact, {checked}")
        return lines
    lines.append(f"FAILED: {report.path} ({report.kind}): {len(report.problems)} problem(s)")
    lines += [f"  {problem}" for problem in report.problems]
    return lines
