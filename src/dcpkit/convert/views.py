"""A checkpoint seen through a family adapter's key plan, tensor by tensor in the other naming:
a DCP checkpoint with Hugging Face names (``ToHF``), a Hugging Face folder with TorchTitan
names (``FromHF``). Transforms (RoPE permutation) are applied on read; a stacked-experts tensor
is one expert per HF key, and is stacked from them on the way back, a block of experts at a
time."""

from __future__ import annotations

from typing import Any

import torch

from dcpkit.convert.adapters.base import ExpertOf, KeyPlan


class ToHF:
    """``src`` (a DCP checkpoint) by HF key."""

    def __init__(self, src: Any, plan: KeyPlan) -> None:
        self.src = src
        self.map = {hf: (s, tf) for s, hf, tf in plan.pairs}

    def names(self) -> list[str]:
        return list(self.map)

    def source(self, hf: str) -> str:
        return self.map[hf][0]

    def shape(self, hf: str) -> tuple[int, ...]:
        s, tf = self.map[hf]
        shape = tuple(self.src.shape(s))
        return shape[1:] if isinstance(tf, ExpertOf) else shape

    def dtype(self, hf: str) -> torch.dtype:
        return self.src.dtype(self.map[hf][0])

    def row_block(self, hf: str) -> int:
        tf = self.map[hf][1]
        return tf.row_block if tf is not None else 1

    def read(self, hf: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        s, tf = self.map[hf]
        if isinstance(tf, ExpertOf):
            t = self.src.read(s, (tf.index, tf.index + 1))[0]
            return t if rows is None else t[rows[0] : rows[1]]
        t = self.src.read(s, rows)
        return tf.to_hf(t) if tf is not None else t


class FromHF:
    """``src`` (a Hugging Face folder) by TorchTitan key."""

    def __init__(self, src: Any, plan: KeyPlan) -> None:
        self.src = src
        self.map: dict[str, list[tuple[str, Any]]] = {}
        for hf, canon, tf in plan.pairs:
            self.map.setdefault(canon, []).append((hf, tf))
        for members in self.map.values():
            if isinstance(members[0][1], ExpertOf):
                members.sort(key=lambda m: m[1].index)

    def names(self) -> list[str]:
        return list(self.map)

    def hf_names(self, canon: str) -> list[str]:
        return [hf for hf, _ in self.map[canon]]

    def stacked(self, canon: str) -> bool:
        return isinstance(self.map[canon][0][1], ExpertOf)

    def shape(self, canon: str) -> tuple[int, ...]:
        members = self.map[canon]
        shape = tuple(self.src.shape(members[0][0]))
        return (len(members), *shape) if self.stacked(canon) else shape

    def dtype(self, canon: str) -> torch.dtype:
        return self.src.dtype(self.map[canon][0][0])

    def nbytes(self, canon: str) -> int:
        return sum(self.src.nbytes(hf) for hf, _ in self.map[canon])

    def row_block(self, canon: str) -> int:
        tf = self.map[canon][0][1]
        return tf.row_block if tf is not None else 1

    def read(self, canon: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        members = self.map[canon]
        if self.stacked(canon):
            a, b = rows if rows is not None else (0, len(members))
            out = torch.empty((b - a, *self.src.shape(members[0][0])), dtype=self.dtype(canon))
            for i in range(a, b):
                out[i - a] = self.src.read(members[i][0])
            return out
        hf, tf = members[0]
        t = self.src.read(hf, rows)
        return tf.from_hf(t) if tf is not None else t
