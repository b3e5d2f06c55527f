"""The ``Trainer``'s conventions for a run's checkpoints in its ``output_dir``: its own
``checkpoint-N`` folders, and the ``checkpoint-N`` links to dcpkit's steps that let
``get_last_checkpoint`` (transformers' example scripts) and a ``checkpoint-N`` path find them."""

from __future__ import annotations

import os
import re
from pathlib import Path

from dcpkit.layout import step_name

TRAINER_STEP = re.compile(r"checkpoint-(0|[1-9][0-9]*)")
"""The Trainer's own name of a step's folder in ``output_dir`` (``get_last_checkpoint``'s)."""


def trainer_folders(out: Path | None) -> list[Path]:
    """The Trainer's own ``checkpoint-N`` folders of a local ``output_dir`` (not the links this
    mixin keeps there), oldest first."""
    if out is None or not out.is_dir():
        return []
    found = []
    for entry in out.iterdir():
        match = TRAINER_STEP.fullmatch(entry.name)
        if match and entry.is_dir() and not entry.is_symlink():
            found.append((int(match.group(1)), entry))
    return [entry for _, entry in sorted(found)]


def link_steps(out: Path, folder: Path, step: int | None, published: list[int]) -> None:
    """``OUTPUT_DIR/checkpoint-N``, a link to ``step-N`` of dcpkit's folder (``step``; None once
    the run's saves are done), where the Trainer's conventions (``get_last_checkpoint``, a
    ``checkpoint-N`` path) look for a run's steps; the links of steps retention removed go (a
    link that points nowhere is never a step to them either). An entry of that name that is
    not such a link (the Trainer's own save) is left alone."""
    newest = max(published, default=-1) if step is None else max([*published, step])
    for entry in out.iterdir():
        match = TRAINER_STEP.fullmatch(entry.name)
        if not match or not entry.is_symlink():
            continue
        n = int(match.group(1))
        mine = os.readlink(entry) == os.path.relpath(folder / step_name(n), out)
        if mine and n not in published and (step is None or n < newest):
            entry.unlink(missing_ok=True)
    link = out / f"checkpoint-{step}"
    if step is not None and not os.path.lexists(link):
        link.symlink_to(os.path.relpath(folder / step_name(step), out), target_is_directory=True)
