"""Checkpoints on disk: ``step-N`` folders, temporary folders, publishing, discovery, retention.

A save writes into ``.tmp-step-N``; only when every rank has finished, the DCP ``.metadata`` is
complete and the manifest (``dcpkit.json``) is written does the folder become ``step-N``, by one
rename. Discovery only ever sees ``step-N`` folders, so a crash at any moment leaves either the
previous checkpoint as "latest" or the new one, complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

STEP_DIR_RE = re.compile(r"^step-(\d+)$")
TEMP_PREFIX = ".tmp-step-"
OLD_PREFIX = ".old-step-"
METADATA = ".metadata"
MANIFEST = "dcpkit.json"
HF_INDEX = "model.safetensors.index.json"
HF_FILES = frozenset({HF_INDEX, "model.safetensors"})
"""Either makes a folder a Hugging Face safetensors folder (an index, or a single file)."""
COMMIT_MARKER = ".dcpkit-committed"
"""Written last into a remote step folder: only then is it a checkpoint (object stores)."""


def step_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"step-{step}"


def temp_dir(folder: str | Path, step: int) -> Path:
    return Path(folder) / f"{TEMP_PREFIX}{step}"


def is_hf(path: str | Path) -> bool:
    """A Hugging Face safetensors folder (an index, or a single ``model.safetensors``)."""
    return any((Path(path) / name).is_file() for name in HF_FILES)


def is_complete(path: str | Path) -> bool:
    """A folder that holds a loadable checkpoint: DCP metadata, or an HF export's index/file."""
    return (Path(path) / METADATA).is_file() or is_hf(path)


def published_steps(folder: str | Path) -> list[int]:
    """Steps of the published, complete checkpoints under ``folder``, ascending."""
    root = Path(folder)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        m = STEP_DIR_RE.match(entry.name)
        if m and entry.is_dir() and is_complete(entry):
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(folder: str | Path) -> int | None:
    steps = published_steps(folder)
    return steps[-1] if steps else None


def leftovers(folder: str | Path) -> list[Path]:
    """Folders left by interrupted saves or publishes (never loadable)."""
    root = Path(folder)
    if not root.is_dir():
        return []
    found = [
        e
        for e in root.iterdir()
        if e.is_dir() and (e.name.startswith(TEMP_PREFIX) or e.name.startswith(OLD_PREFIX))
    ]
    # step-N folders without metadata: written by something that crashed before finishing.
    found += [
        e for e in root.iterdir() if e.is_dir() and STEP_DIR_RE.match(e.name) and not is_complete(e)
    ]
    return sorted(found)


def clean_leftovers(folder: str | Path) -> list[Path]:
    removed = leftovers(folder)
    for path in removed:
        logger.warning("removing %s, left by an interrupted save", path)
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_durably(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def publish(tmp: Path, final: Path) -> None:
    """Make ``tmp`` visible as ``final`` in one rename (replacing an older ``final``)."""
    if not is_complete(tmp):
        raise RuntimeError(f"refusing to publish {tmp}: it holds no complete checkpoint")
    _fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(f"{OLD_PREFIX}{final.name[len('step-') :]}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def apply_retention(folder: str | Path, keep_latest_k: int) -> list[int]:
    """Delete the oldest published checkpoints beyond ``keep_latest_k`` (0 keeps all)."""
    if keep_latest_k <= 0:
        return []
    steps = published_steps(folder)
    doomed = steps[:-keep_latest_k] if len(steps) > keep_latest_k else []
    for step in doomed:
        path = step_dir(folder, step)
        # Rename first so that a crash half-way through the delete never leaves a step-N
        # folder that looks complete but is missing files.
        trash = Path(folder) / f"{OLD_PREFIX}{step}"
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def read_manifest(path: str | Path) -> dict[str, Any] | None:
    p = Path(path) / MANIFEST
    if not p.is_file():
        return None
    with open(p) as f:
        return json.load(f)


@dataclass
class FolderEntry:
    name: str
    step: int | None
    size: int
    mtime: float
    status: str


def _tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def describe_folder(folder: str | Path) -> list[FolderEntry]:
    """Every checkpoint-like entry under ``folder``: published ones and interrupted leftovers."""
    root = Path(folder)
    rows = []
    leftover = {p.name for p in leftovers(root)}
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        m = STEP_DIR_RE.match(entry.name)
        if entry.name in leftover:
            digits = entry.name.rsplit("-", 1)[-1]
            step = int(digits) if digits.isdigit() else None
            status = "incomplete (interrupted save; never loaded, removed by the next save)"
        elif m:
            step = int(m.group(1))
            manifest = read_manifest(entry)
            if manifest is None:
                status = "published (no dcpkit manifest)"
            elif manifest.get("model_only"):
                status = f"published, model only ({manifest.get('dtype')})"
            else:
                status = f"published, {manifest.get('world_size')} rank(s)"
        else:
            continue
        rows.append(FolderEntry(entry.name, step, _tree_size(entry), entry.stat().st_mtime, status))
    rows.sort(key=lambda r: (r.step is None, r.step or 0, r.name))
    return rows
