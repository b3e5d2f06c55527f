"""Writing ``torch.save`` files one tensor (or one block of rows) at a time: the archive is laid
out with ``torch.serialization.skip_data`` (so the format is torch's own), then each storage's
bytes are filled in place."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcpkit.formats.torchfile import TensorRef, TorchSaveFile, _walk, walk_refs


def _fake_like(shape: tuple[int, ...], dtype: torch.dtype, mode: Any) -> torch.Tensor:
    with mode:
        return torch.empty(shape, dtype=dtype)


class TorchSaveWriter:
    """Writes a ``torch.save`` file whose tensors are filled in afterwards, block by block.

    ``layout`` is the object to save with ``TensorSpec`` leaves (anything else is saved as is).
    After construction, ``write(key, tensor, rows)`` puts data in place; ``close()`` makes it
    durable. ``torch.load`` reads the result like any other ``torch.save`` file.
    """

    def __init__(
        self, path: Path, layout: Any, leaves: list[tuple[str, tuple[int, ...], torch.dtype]]
    ) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.serialization import skip_data

        self.path = path
        mode = FakeTensorMode()
        fakes: dict[str, torch.Tensor] = {}
        for key, shape, dtype in leaves:
            fakes[key] = _fake_like(shape, dtype, mode)
        obj = _substitute(layout, fakes)
        with skip_data(materialize_fake_tensors=True):
            torch.save(obj, str(path))
        # Read the layout back to learn where each storage's bytes went.
        with open(path, "rb") as f:
            reader = TorchSaveFile(f)
            refs = _collect_refs(reader.obj)
            offsets = dict(reader._offsets)
        specs: dict[str, str] = {}
        walk_specs(layout, lambda p, spec: specs.__setitem__(p, spec.key))
        if refs.keys() != specs.keys():
            raise RuntimeError("torch.save layout does not match the tensors to write")
        self._where: dict[str, tuple[int, TensorRef]] = {
            specs[p]: (offsets[ref.record], ref) for p, ref in refs.items()
        }
        self.f = open(path, "r+b")  # noqa: SIM115

    def write(self, key: str, tensor: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        offset, ref = self._where[key]
        row_bytes = ref.nbytes // ref.shape[0] if ref.shape and ref.shape[0] else 0
        start = offset + (rows[0] * row_bytes if rows else 0)
        data = tensor.to(ref.dtype).contiguous().reshape(-1).view(torch.uint8).numpy()
        self.f.seek(start)
        self.f.write(memoryview(data))

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


@dataclass(frozen=True)
class TensorSpec:
    """A placeholder for a tensor in the layout given to ``TorchSaveWriter``."""

    key: str


def _substitute(obj: Any, fakes: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, TensorSpec):
        return fakes[obj.key]
    if isinstance(obj, dict):
        return {k: _substitute(v, fakes) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, fakes) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_substitute(v, fakes) for v in obj)
    return obj


def _collect_refs(obj: Any, prefix: str = "") -> dict[str, TensorRef]:
    """Flattened ``{dotted.path: TensorRef}`` of a loaded layout, in pickle order."""
    out: dict[str, TensorRef] = {}
    walk_refs(obj, lambda path, ref: out.__setitem__(path, ref), prefix)
    return out


def walk_specs(obj: Any, fn: Callable[[str, TensorSpec], None]) -> None:
    _walk(obj, TensorSpec, fn, "")
