"""FP8 weights with block scales (DeepSeek-V3's published format), dequantized as they are read.

Each ``X.weight`` stored as ``float8_e4m3fn`` comes with ``X.weight_scale_inv``, one float32 per
128 x 128 block (``quantization_config.weight_block_size``); the weight is
``w[i, j] = float(q[i, j]) * scale_inv[i // 128, j // 128]``, computed in float32 and cast to the
target dtype. Reads are by row block, so a conversion holds one block of one weight at a time.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size(config: dict | None) -> tuple[int, int]:
    q = (config or {}).get("quantization_config") or {}
    size = q.get("weight_block_size") or [128, 128]
    if (
        not isinstance(size, list)
        or len(size) != 2
        or not all(isinstance(s, int) and s > 0 for s in size)
    ):
        raise ConversionError(f"config.json: weight_block_size {size!r} is not two positive ints")
    return size[0], size[1]


def dequantize(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
    skip: int = 0,
) -> torch.Tensor:
    """``q * scale_inv`` computed in float32 with each scale spread over its ``block``, cast to
    ``dtype``; ``q``'s rows start at a block boundary, and the first ``skip`` rows are left out.
    One block row at a time: the float32 temporaries stay one band of blocks."""
    bh, bw = block
    out = torch.empty((q.shape[0] - skip, *q.shape[1:]), dtype=dtype)
    for i, start in enumerate(range(0, q.shape[0], bh)):
        band = q[start : start + bh].float()
        scales = scale_inv[i].float().repeat_interleave(bw)[: q.shape[1]]
        band = band * scales
        lo = max(start, skip)
        if lo < start + band.shape[0]:
            out[lo - skip : start + band.shape[0] - skip] = band[lo - start :]
    return out


class Dequantized:
    """A Hugging Face folder whose block-scaled FP8 weights read as ``dtype``; the scale tensors
    are consumed, not listed."""

    def __init__(self, src: Any, dtype: torch.dtype, block: tuple[int, int], where: str) -> None:
        self.src, self.out_dtype, self.block = src, dtype, block
        names = set(src.names())
        self.scales: dict[str, str] = {}
        for key in names:
            if not key.endswith(SCALE_SUFFIX):
                continue
            weight = key[: -len(SCALE_SUFFIX)]
            if weight not in names:
                raise ConversionError(f"{where}: {key} scales {weight}, which the folder lacks")
            shape = src.shape(weight)
            want = tuple(math.ceil(n / b) for n, b in zip(shape, block))
            if len(shape) != 2 or tuple(src.shape(key)) != want:
                raise ConversionError(
                    f"{where}: {key} has shape {list(src.shape(key))}, but {weight} "
                    f"{list(shape)} in {block[0]}x{block[1]} blocks needs {list(want)}"
                )
            if src.dtype(weight) not in FP8_DTYPES:
                raise ConversionError(
                    f"{where}: {weight} has a block scale but is {src.dtype(weight)}, not FP8"
                )
            self.scales[weight] = key

    def names(self) -> list[str]:
        return [k for k in self.src.names() if k not in self.scales.values()]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.src.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.out_dtype if key in self.scales else self.src.dtype(key)

    def nbytes(self, key: str) -> int:
        return math.prod(self.shape(key)) * self.dtype(key).itemsize

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if key not in self.scales:
            return self.src.read(key, rows)
        bh = self.block[0]
        start, stop = rows if rows is not None else (0, self.shape(key)[0])
        first = start // bh
        q = self.src.read(key, (first * bh, stop))
        s = self.src.read(self.scales[key], (first, math.ceil(stop / bh)))
        return dequantize(q, s, self.block, self.out_dtype, skip=start - first * bh)

    def config(self) -> dict | None:
        return self.src.config()

    def close(self) -> None:
        self.src.close()


def dequantizing(src: Any, dtype: torch.dtype | None, where: str) -> Any:
    """``src`` itself, or seen through :class:`Dequantized` when it holds block-scaled FP8."""
    if not any(k.endswith(SCALE_SUFFIX) for k in src.names()):
        return src
    return Dequantized(src, dtype or torch.bfloat16, block_size(src.config()), where)
