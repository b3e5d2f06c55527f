"""TorchTitan's warmup-stable-decay learning-rate schedule as a picklable LambdaLR factor."""

from __future__ import annotations

import math

import torch

from dcpkit.train.config import LRScheduler


class WarmupStableDecay:
    """lr factor at a step: linear warmup, a flat stretch, then linear/sqrt/cosine decay."""

    def __init__(self, steps: int, cfg: LRScheduler) -> None:
        self.warmup = min(cfg.warmup_steps, steps)
        after = steps - self.warmup
        ratio = 1.0 if cfg.decay_ratio is None else cfg.decay_ratio
        self.decay = max(1, round(after * ratio)) if after > 0 else 1
        self.stable = max(0, after - self.decay)
        self.decay_type = cfg.decay_type
        self.min_lr_factor = cfg.min_lr_factor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if step < self.warmup + self.stable:
            return 1.0
        progress = min(1.0, (step + 1 - self.warmup - self.stable) / self.decay)
        if self.decay_type == "linear":
            factor = 1.0 - progress
        elif self.decay_type == "sqrt":
            factor = 1.0 - math.sqrt(progress)
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, steps: int, cfg: LRScheduler
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupStableDecay(steps, cfg))
