"""Any checkpoint as a set of named tensors: DCP folders, Hugging Face safetensors folders and
``torch.save`` files, behind one small read interface (used by inspect, verify and diff).

    names() -> list[str]; shape(name); dtype(name); read(name, rows=None) -> Tensor; close()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from dcpkit import layout
from dcpkit.convert.dcpio import DCPCheckpoint, NotACheckpoint
from dcpkit.convert.safetensors_io import SafetensorsFolder
from dcpkit.convert.torchfile import TensorRef, TorchSaveFile, walk_refs

DCP, HF, TORCH = "dcp", "hf-safetensors", "torch-save"


class TensorSource(Protocol):
    kind: str
    path: Path

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor: ...

    def close(self) -> None: ...


class DCPSource(DCPCheckpoint):
    kind = DCP

    def names(self) -> list[str]:
        return list(self.tensors)


class HFSource(SafetensorsFolder):
    kind = HF


class TorchSource:
    """Tensors of a ``torch.save`` file, read on demand (dotted names for nested dicts)."""

    kind = TORCH

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "rb")  # noqa: SIM115
        try:
            self.archive = TorchSaveFile(self._f)
        except Exception:
            self._f.close()
            raise
        self.refs: dict[str, TensorRef] = {}
        walk_refs(self.archive.obj, self.refs.__setitem__)

    def names(self) -> list[str]:
        return list(self.refs)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.refs[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.refs[name].dtype

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.archive.read(self.refs[name], rows)

    def close(self) -> None:
        self._f.close()


def detect_kind(path: Path) -> str:
    """What ``path`` holds; an error that says what to pass when it is none of them."""
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if path.is_dir():
        if (path / layout.METADATA).is_file():
            return DCP
        if layout.is_hf(path) or any(path.glob("*.safetensors")):
            return HF
        steps = layout.published_steps(path)
        hint = (
            f"; it holds checkpoints {', '.join(f'step-{s}' for s in steps)}: pass one of them"
            if steps
            else ""
        )
        raise NotACheckpoint(
            f"{path} is not a checkpoint: no DCP {layout.METADATA}, no safetensors{hint}"
        )
    if path.suffix == ".safetensors":
        return HF
    return TORCH


def open_source(path: str | Path) -> Any:
    """Open ``path`` as a ``TensorSource`` of the right kind."""
    p = Path(path)
    kind = detect_kind(p)
    if kind == DCP:
        return DCPSource(p)
    if kind == HF:
        return HFSource(p)
    try:
        return TorchSource(p)
    except ValueError as e:
        raise NotACheckpoint(f"{p} is not a checkpoint: {e}") from None
