"""What every tensor reader offers: names, shapes and dtypes, and reads of whole tensors or
row ranges, so that inspect, verify, diff and the conversions treat every format alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch


class TensorSource(Protocol):
    kind: str
    path: Path

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor: ...

    def close(self) -> None: ...


class TensorTable:
    """Names, shapes and dtypes from a table of entries that carry ``shape`` and ``dtype``."""

    entries: dict[str, Any]

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].dtype

    def nbytes(self, name: str) -> int:
        n = self.dtype(name).itemsize
        for s in self.shape(name):
            n *= s
        return n
