"""The ``Trainer``'s conventions for a run's checkpoints in its ``output_dir``: its own
``checkpoint-N`` folders, and the ``checkpoint-N`` links to dcpkit's steps that let
``get_last_checkpoint`` (transformers' example scripts) and a ``checkpoint-N`` path find them;
and the check of a saved ``TrainerState`` before the Trainer reads it."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

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


def trainer_state_problem(raw: bytes) -> str | None:
    """What keeps the saved JSON ``raw`` from being the installed release's ``TrainerState``
    (``TrainerState(**json)``, as the Trainer reads it): no JSON object, a field it does not
    have, or a value of another type than its field's (an int for an int, a number for a
    float, a list for a list...). None when it is one."""
    from transformers import TrainerState

    try:
        state = json.loads(raw)
    except ValueError as e:
        return f"not a JSON document ({e})"
    if not isinstance(state, dict):
        return f"a JSON {type(state).__name__}, not the object of a TrainerState"
    fields = {f.name: f.type for f in dataclasses.fields(TrainerState)}
    unknown = sorted(set(state) - set(fields))
    if unknown:
        return f"fields this release's TrainerState does not have: {', '.join(unknown)}"
    for name, value in state.items():
        if not _fits(value, fields[name]):
            kind = fields[name]
            return (
                f"{name} = {value!r}, where a TrainerState holds {getattr(kind, '__name__', kind)}"
            )
    return None


def _fits(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits a field of scalars (int, float, bool, str, or None where the
    field allows it); other fields are left to the Trainer (their JSON is not their type: the
    callbacks' states are saved as an object where the field holds a list of callbacks)."""
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    options = typing.get_args(annotation) if union else (annotation,)
    if not all(o in (int, float, bool, str, type(None)) for o in options):
        return True
    if value is None:
        return type(None) in options
    if isinstance(value, bool):
        return bool in options
    if isinstance(value, int):
        return int in options or float in options
    return any(o is not type(None) and isinstance(value, o) for o in options)


def keep_tokenizer(out: Path, tokenizer: Any) -> bool:
    """The run's tokenizer (the Trainer's ``processing_class``), saved once into ``output_dir``
    beside the checkpoint folder, where ``dcpkit to-hf`` of a step finds it (the Trainer's own
    ``checkpoint-N`` holds a copy each); whether it was saved now."""
    from dcpkit.convert.hf_files import TOKENIZER_FILES

    if not hasattr(tokenizer, "save_pretrained") or any(
        (out / n).is_file() for n in TOKENIZER_FILES
    ):
        return False
    tokenizer.save_pretrained(str(out))
    return True
