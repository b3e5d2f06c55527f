"""Gradient-norm clipping that works when gradients mix plain tensors and DTensors of different
meshes or placements (tensor parallel without FSDP leaves the norms' gradients plain)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, pp_group: Any = None
) -> float:
    """Scale gradients so that their global 2-norm is at most ``max_norm``; returns the norm.
    ``pp_group``: the pipeline ranks, whose stages hold the other parameters."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, 2.0, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares.append(norm.float() ** 2)
    square = torch.stack(squares).sum() if squares else torch.zeros(())
    if pp_group is not None:
        torch.distributed.all_reduce(square, group=pp_group)
    elif not squares:
        return 0.0
    total = float(square.sqrt())
    coef = min(1.0, max_norm / (total + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total
