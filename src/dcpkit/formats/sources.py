"""Any checkpoint as a set of named tensors: DCP folders, Hugging Face safetensors folders and
``torch.save`` files, behind one small read interface (used by inspect, verify and diff).

    names() -> list[str]; shape(name); dtype(name); read(name, rows=None) -> Tensor; close()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dcpkit.formats.base import TensorTable
from dcpkit.formats.dcp import DCPCheckpoint, NotACheckpoint
from dcpkit.formats.safetensors import SafetensorsFolder
from dcpkit.formats.torchfile import TensorRef, TorchSaveFile, walk_refs
from dcpkit.layout import HF_FILES, METADATA, parse_step, step_name

DCP, HF, TORCH = "dcp", "hf-safetensors", "torch-save"


class DCPSource(DCPCheckpoint):
    kind = DCP

    def names(self) -> list[str]:
        return list(self.tensors)


class HFSource(SafetensorsFolder):
    kind = HF


class TorchSource(TensorTable):
    """Tensors of a ``torch.save`` file, read on demand (dotted names for nested dicts)."""

    kind = TORCH

    def __init__(self, path: Path, opener: Any = None, trust_pickle: bool = False) -> None:
        self.path = path
        self._f = opener(path) if opener is not None else open(path, "rb")  # noqa: SIM115
        try:
            self.archive = TorchSaveFile(self._f, trust_pickle=trust_pickle)
        except Exception:
            self._f.close()
            raise
        self.refs: dict[str, TensorRef] = {}
        walk_refs(self.archive.obj, self.refs.__setitem__)
        self.entries = self.refs

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.archive.read(self.refs[name], rows)

    def close(self) -> None:
        self._f.close()


def detect_kind(path: Path) -> str:
    """What ``path`` holds; an error that says what to pass when it is none of them."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        if (path / METADATA).is_file():
            return DCP
        if any((path / n).is_file() for n in HF_FILES) or any(path.glob("*.safetensors")):
            return HF
        steps = sorted(
            step
            for entry in path.iterdir()
            if (step := parse_step(entry.name)) is not None and (entry / METADATA).is_file()
        )
        hint = (
            f"; it holds checkpoints {', '.join(step_name(s) for s in steps)}: pass one of them"
            if steps
            else ""
        )
        raise NotACheckpoint(f"{path} is not a checkpoint: no DCP {METADATA}, no safetensors{hint}")
    if path.suffix == ".safetensors":
        return HF
    return TORCH


def open_source(
    path: str | Path, opener: Any = None, trust_pickle: bool = False, bounded: bool = False
) -> Any:
    """Open ``path`` as a ``TensorSource`` of the right kind (``opener``: how its files' bytes
    are read, for a metadata-only copy of a remote checkpoint; ``bounded``: a DCP checkpoint's
    ``.metadata`` read into arrays, for a look at it)."""
    p = Path(path)
    kind = detect_kind(p)
    if kind == DCP:
        return DCPSource(p, opener, bounded)
    if kind == HF:
        return HFSource(p, opener)
    try:
        return TorchSource(p, opener, trust_pickle)
    except ValueError as e:
        raise NotACheckpoint(f"{p} is not a checkpoint: {e}") from None
