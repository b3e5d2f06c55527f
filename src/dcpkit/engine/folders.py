"""The folders a manager is given, checked before anything trains or is written: a file named as
a folder, a run's checkpoint folder (or one of its steps) given where the run's own folder was
meant, which would otherwise start a fresh run beside published steps one level up, and a used
folder saved into without a load, refused at the first step rather than at the first save."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from dcpkit import dist
from dcpkit.config import CheckpointConfig, ConfigError
from dcpkit.console import summary
from dcpkit.engine.publish import StepInfo, retrying_alone, save_failure
from dcpkit.errors import CheckpointError, transient
from dcpkit.layout import parse_step
from dcpkit.storage.opening import local_path

logger = logging.getLogger(__name__)

_STEP_FILES = (".metadata", "dcpkit.json")  # what makes a step-N folder a checkpoint


def _steps_in(folder: Path) -> list[str]:
    """The names of the checkpoint steps directly in ``folder`` (a missing folder has none)."""
    try:
        entries = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    steps = [
        p.name
        for p in entries
        if parse_step(p.name) is not None
        and p.is_dir()
        and any((p / f).is_file() for f in _STEP_FILES)
    ]
    return sorted(steps, key=parse_step)


def _named(steps: list[str]) -> str:
    return ", ".join(steps[:3]) + (f" and {len(steps) - 3} more" if len(steps) > 3 else "")


def check_folders(config: CheckpointConfig, base_folder: Any, root: Any) -> None:
    """A manager's folders checked before anything trains (``check_base_folder``); with
    checkpointing off, that it is off said once, with how to turn it on."""
    if config.enable:
        check_base_folder(base_folder, config.folder, root)
    else:
        summary(
            logger,
            "checkpoint: checkpointing is off, so this run saves and loads nothing; turn it on "
            "with [checkpoint] enable = true (CheckpointConfig(enable=True) in a script)",
        )


def check_base_folder(base_folder: Any, folder: str, root: Any) -> None:
    """Refuse, naming the path and the fix, a base folder (or checkpoint folder ``root``) that is
    a file, and a base folder that is itself a run's checkpoint folder or lies inside one.
    Local folders only: an object store has no files in the way of folders, and listing it
    here would cost a request per start."""
    base, root_path = local_path(base_folder), local_path(root)
    if base is None or root_path is None:
        return
    for path, what in ((base, "base folder"), (root_path, "checkpoint folder")):
        if path.exists() and not path.is_dir():
            raise ConfigError(
                f"{path}: the {what} is a file, not a folder. The base folder is the run's own "
                f"folder, where `{folder}/` holds the checkpoints (made when missing); give a "
                "folder, or move the file away"
            )
    if root_path.resolve() == base.resolve() or _steps_in(root_path):
        return  # the checkpoints are in the folder given, or this run's folder has its own
    steps = _steps_in(base)
    if steps:
        raise ConfigError(
            f"{base} is itself a checkpoint folder (it holds {_named(steps)}), so this run would "
            f"look for its checkpoints in {root_path} and start fresh. The folder to give is the "
            f"run's own, which holds `{base.name}/`: did you mean {base.parent}?"
        )
    inside = _steps_in(base.parent)
    if inside:
        where = "is a step of" if base.name in inside else "lies inside"
        raise ConfigError(
            f"{base} {where} the checkpoint folder {base.parent} (it holds {_named(inside)}); "
            f"the folder to give is the run's own, which holds `{base.parent.name}/`: did you "
            f"mean {base.parent.parent}?"
        )


def check_unused(info: StepInfo) -> bool:
    """Every rank, at a manager's first ``save()`` when no ``load()`` came before it (a collective):
    refuse a checkpoint folder holding a published step at or after ``info.step``, which a run
    that starts fresh there would interleave with (and `latest` would name the earlier run's
    step), at the first step instead of at the first save ``interval`` steps later. A folder
    that cannot be listed within ``storage_retry_s`` fails the save on every rank, as a save's
    own listing does. Returns False: the check is made once."""
    store, step, problem = info.store, info.step, None
    if dist.rank() == 0:
        try:
            later = [s for s in retrying_alone(store.published_steps, info.retry_s) if s >= step]
        except Exception as e:
            tried = f"; retried for {info.retry_s:.0f}s ([checkpoint] storage_retry_s): giving up"
            later, problem = [], save_failure(e, info, {}) + (tried if transient(e) else "")
        if later:
            problem = (
                f"{store.root} holds published steps of an earlier run (up to step-{max(later)}) "
                f"and this run saves step {step} without having loaded: it would start afresh "
                f"beside them, and `latest` would be that run's step-{max(later)}. Call load() "
                "before training to resume from it, use another checkpoint folder (with "
                "[checkpoint] initial_load_path to start from a checkpoint of this one), or remove "
                "the steps yourself if they are unwanted"
            )
    problem = dist.broadcast_object(problem)
    if problem:
        raise CheckpointError(problem)
    return False
