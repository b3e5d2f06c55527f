"""The pieces of training state a checkpoint holds, each as a small Stateful object.

A checkpoint uses TorchTitan's top-level layout: model parameters flattened at the top level
(``tok_embeddings.weight``, ...) beside ``optimizer``, ``lr_scheduler``, ``dataloader``,
``train_state`` and dcpkit's ``rng``. Sharded tensors (FSDP2 / TP DTensors) stay sharded: DCP
writes each rank's shards and reshards them on load.
"""

from __future__ import annotations

import logging
import pickle
import random
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcpkit.layout import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, RNG

logger = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    """What a checkpointed object provides (``torch.distributed.checkpoint.stateful.Stateful``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    return list(obj) if isinstance(obj, (list, tuple)) else [obj]


class ModelState:
    """Parameters of one or more model parts (pipeline stages), flattened into one dict."""

    def __init__(self, model: nn.Module | Sequence[nn.Module]) -> None:
        self.parts: list[nn.Module] = as_list(model)
        if not self.parts:
            raise ValueError("CheckpointManager needs a model (an nn.Module or a list of them)")

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part in self.parts:
            merged.update(get_model_state_dict(part))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizerState:
    """Optimizer state flattened by parameter name, so it reshards like the parameters."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(
        self, model: nn.Module | Sequence[nn.Module], optimizer: Any | Sequence[Any]
    ) -> None:
        self.parts = as_list(model)
        self.optimizers = as_list(optimizer)
        if len(self.optimizers) != len(self.parts):
            raise ValueError(
                f"{len(self.parts)} model parts but {len(self.optimizers)} optimizers: pass one "
                "optimizer per model part"
            )

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            merged.update(get_optimizer_state_dict(part, opt, options=self._OPTIONS))
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, opt in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state_dict, options=self._OPTIONS)


class SchedulerState:
    """One or more lr schedulers that step together; the first one's state is saved."""

    def __init__(self, schedulers: Any | Sequence[Any]) -> None:
        self.schedulers = as_list(schedulers)

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for sched in self.schedulers:
            sched.load_state_dict(dict(state_dict))


def collect_states(
    model: nn.Module | Sequence[nn.Module],
    optimizer: Any,
    lr_scheduler: Any,
    dataloader: Stateful | None,
    states: dict[str, Stateful] | None,
) -> dict[str, Stateful]:
    """The state groups a checkpoint holds besides the model, by their top-level names."""
    out: dict[str, Stateful] = {}
    if optimizer is not None:
        out[OPTIMIZER] = OptimizerState(model, optimizer)
    if lr_scheduler is not None:
        out[LR_SCHEDULER] = SchedulerState(lr_scheduler)
    if dataloader is not None:
        out[DATALOADER] = dataloader
    for name, obj in (states or {}).items():
        if name in out or name in (MODEL, RNG):
            raise ValueError(f"state name {name!r} is reserved by CheckpointManager")
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"states[{name!r}] must have state_dict() and load_state_dict(), "
                f"got {type(obj).__name__}"
            )
        out[name] = obj
    return out


def capture_rng() -> bytes:
    """This process's RNG states: Python, NumPy, torch CPU and every CUDA device present."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return pickle.dumps(state)


def restore_rng(blob: bytes, reseed_offset: int = 0) -> None:
    """Restore what ``capture_rng`` captured; a non-zero ``reseed_offset`` then forks every
    generator into a new, reproducible stream (used for ranks a checkpoint did not have)."""
    state = pickle.loads(blob)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        saved = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(saved)
    if reseed_offset:
        seed = (random.getrandbits(63) + reseed_offset * 0x9E3779B97F4A7C15) % (2**63)
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.manual_seed(seed)


def rng_source_rank(rank: int, saved_world_size: int) -> tuple[int, int]:
    """The documented rule for RNG at another world size.

    Rank ``r`` restores the state saved by rank ``r % saved_world_size``. A rank the checkpoint
    did not have (``r >= saved_world_size``) then forks that state with offset
    ``r // saved_world_size`` so that no two ranks share a stream. Returns (source rank, offset).
    """
    return rank % saved_world_size, rank // saved_world_size


def rng_key(rank: int) -> str:
    return f"rank_{rank}"
