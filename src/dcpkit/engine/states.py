"""The pieces of training state a checkpoint holds, each as a small Stateful object.

A checkpoint uses TorchTitan's top-level layout: model parameters flattened at the top level
(``tok_embeddings.weight``, ...) beside ``optimizer``, ``lr_scheduler``, ``dataloader``,
``train_state`` and dcpkit's ``rng``. Sharded tensors (FSDP2 / TP DTensors) stay sharded: DCP
writes each rank's shards and reshards them on load.
"""

from __future__ import annotations

import logging
import operator
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

try:  # torch's own steps of get_model_state_dict / get_optimizer_state_dict, to reuse a set-up
    from torch.distributed.checkpoint.state_dict import (
        _gc_context,
        _get_model_state_dict,
        _get_optim_state_dict,
        _verify_options,
        _verify_state_dict,
    )
except ImportError:  # a torch without them: every call sets up anew, through the public API
    _verify_options = None

from dcpkit import dist
from dcpkit.engine.values import check_storable, fingerprint
from dcpkit.layout import DATALOADER, LR_SCHEDULER, MODEL, OPTIMIZER, RNG
from dcpkit.safe_pickle import load_legacy_rng

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


class _Collector:
    """``get_model_state_dict`` / ``get_optimizer_state_dict`` of one model part, with torch's
    set-up (options, FSDP context, a name for every parameter: a walk of every module, which at
    small sizes costs more than the collection itself) built once and reused while the part's
    parameters are the same objects; a parameter replaced or added builds it again."""

    def __init__(self, part: nn.Module, optims: tuple[Any, ...], options: StateDictOptions) -> None:
        self.part, self.optims, self.options = part, optims, options
        self._params: tuple[Any, ...] = ()
        self._info: Any = None

    def state_dict(self) -> dict[str, Any]:
        if _verify_options is None:
            if self.optims:
                return get_optimizer_state_dict(self.part, self.optims, options=self.options)
            return get_model_state_dict(self.part, options=self.options)
        with _gc_context():
            params = tuple(self.part.parameters())
            if len(params) != len(self._params) or any(map(operator.is_not, params, self._params)):
                optim_only = bool(self.optims)
                self._info = _verify_options(
                    self.part, self.optims, optim_only=optim_only, options=self.options
                )
                self._params = params
            info = self._info
            if self.optims:
                optim_sd = _get_optim_state_dict(self.part, self.optims, info)
                _verify_state_dict({}, optim_sd, info)
                return optim_sd
            model_sd = _get_model_state_dict(self.part, info)
            _verify_state_dict(model_sd, {}, info)
            return model_sd


class ModelState:
    """Parameters of one or more model parts (pipeline stages), flattened into one dict.

    ``model`` may also be a framework's own model state: an object with ``state_dict()``,
    ``load_state_dict()`` and its modules as ``model`` (TorchTitan's ``ModelWrapper``, whose
    state dict its models' hooks shape, e.g. a fused QKV projection saved as ``wq wk wv``):
    its state dict is then saved and restored as it makes it."""

    def __init__(self, model: nn.Module | Sequence[nn.Module] | Stateful) -> None:
        wrapper = not isinstance(model, nn.Module | list | tuple) and isinstance(model, Stateful)
        self.wrapper: Stateful | None = model if wrapper else None  # type: ignore[assignment]
        self.parts: list[nn.Module] = as_list(getattr(model, "model", None) if wrapper else model)
        if not self.parts:
            raise ValueError("CheckpointManager needs a model (an nn.Module or a list of them)")
        self._collectors = [_Collector(p, (), StateDictOptions()) for p in self.parts]

    def state_dict(self) -> dict[str, Any]:
        if self.wrapper is not None:
            return dict(self.wrapper.state_dict())
        merged: dict[str, Any] = {}
        for collector in self._collectors:
            merged.update(collector.state_dict())
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.wrapper is not None:
            self.wrapper.load_state_dict(state_dict)
            return
        for part in self.parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


EMPTY_GROUPS = "empty_param_groups"


class OptimizerState:
    """Optimizer state flattened by parameter name, so it reshards like the parameters.

    torch's flattened layout keeps a parameter group's settings under its parameters' names
    (``param_groups.<fqn>.lr``), so a group without parameters (a LoRA run's no-decay group)
    has none, and torch cannot load such a state back. Each empty group's settings are saved
    under ``empty_param_groups.<optimizer>.<group>.<name>`` instead, and the load sets the
    groups that have parameters through torch, then puts the empty ones back in their places
    with their saved settings."""

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
        self._collectors = [
            _Collector(part, (opt,), self._OPTIONS)
            for part, opt in zip(self.parts, self.optimizers)
        ]

    def state_dict(self) -> dict[str, Any]:
        merged: dict[str, Any] = {}
        for i, collector in enumerate(self._collectors):
            opt = self.optimizers[i]
            _check_groups(self.parts[i], opt)
            if any(group["params"] for group in opt.param_groups):
                merged.update(collector.state_dict())
            for g, group in _empty_groups(opt):
                for name, value in group.items():
                    if name != "params":
                        merged[f"{EMPTY_GROUPS}.{i}.{g}.{name}"] = value
        return merged

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for i, (part, opt) in enumerate(zip(self.parts, self.optimizers)):
            empty = _empty_groups(opt)
            if not empty:
                set_optimizer_state_dict(part, opt, state_dict, options=self._OPTIONS)
                continue
            opt.param_groups[:] = [group for group in opt.param_groups if group["params"]]
            try:
                if opt.param_groups:
                    set_optimizer_state_dict(part, opt, state_dict, options=self._OPTIONS)
            finally:  # loaded or not, every group back in its place
                for g, group in empty:
                    for name in group:
                        key = f"{EMPTY_GROUPS}.{i}.{g}.{name}"
                        if name != "params" and key in state_dict:
                            group[name] = state_dict[key]
                    opt.param_groups.insert(g, group)


def _check_groups(part: nn.Module, optimizer: Any) -> None:
    """Refuses, at the save, an optimizer whose state could not be loaded back: one holding a
    parameter that is not the model's (its state would have no name in the checkpoint)."""
    from dcpkit.errors import CheckpointError

    own = {id(p) for p in part.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            if id(param) not in own:
                raise CheckpointError(
                    f"the optimizer's parameter group {g} holds a parameter of shape "
                    f"{tuple(param.shape)} that is not a parameter of the model it is saved "
                    "with: its state would have no name in the checkpoint and could not be "
                    "loaded back. Give the optimizer the model's own parameters (or register "
                    "the tensor in the model, e.g. as an nn.Parameter attribute)"
                )


def _empty_groups(optimizer: Any) -> list[tuple[int, dict[str, Any]]]:
    """(index, group) of each parameter group of ``optimizer`` that holds no parameter."""
    return [(g, group) for g, group in enumerate(optimizer.param_groups) if not group["params"]]


class SchedulerState:
    """One or more lr schedulers that step together; the first one's state is saved."""

    def __init__(self, schedulers: Any | Sequence[Any]) -> None:
        self.schedulers = as_list(schedulers)

    def state_dict(self) -> dict[str, Any]:
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for sched in self.schedulers:
            sched.load_state_dict(dict(state_dict))


class PerRank:
    """A state whose value differs between ranks (a sampler's position, a data iterator):
    saved under rank-specific keys ``NAME.rank_R``, so that no rank's value is lost.

    At another world size, rank ``r`` restores the value saved by rank ``r % saved_world_size``
    (logged), unless the object has ``reshard_state_dict(saved, rank, world_size)``: it then
    receives every saved rank's state dict, in rank order, and returns its own."""

    def __init__(self, obj: Stateful) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {rank_key(dist.rank()): self.obj.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(state_dict)


def collect_states(
    model: nn.Module | Sequence[nn.Module],
    optimizer: Any,
    lr_scheduler: Any,
    dataloader: Stateful | None,
    states: dict[str, Stateful] | None,
    per_rank_states: dict[str, Stateful] | None = None,
) -> dict[str, Stateful]:
    """The state groups a checkpoint holds besides the model, by their top-level names."""
    out: dict[str, Stateful] = {}
    if optimizer is not None:
        out[OPTIMIZER] = OptimizerState(model, optimizer)
    if lr_scheduler is not None:
        out[LR_SCHEDULER] = SchedulerState(lr_scheduler)
    if dataloader is not None:
        if not isinstance(dataloader, Stateful):
            raise TypeError(
                f"dataloader= must have state_dict() and load_state_dict() so that a resume "
                f"continues from the same batch; a {type(dataloader).__name__} has not (a plain "
                "torch.utils.data.DataLoader keeps no position). Use torchdata's "
                "StatefulDataLoader (torchdata.stateful_dataloader), or pass a sampler whose "
                "state_dict() holds its position in states={'sampler': sampler}"
            )
        out[DATALOADER] = dataloader
    given = [(n, o, False) for n, o in (states or {}).items()]
    given += [(n, o, True) for n, o in (per_rank_states or {}).items()]
    for name, obj, per_rank in given:
        if name in out or name in (MODEL, RNG) or "." in name:
            raise ValueError(f"state name {name!r} is reserved by CheckpointManager or taken")
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"states[{name!r}] must have state_dict() and load_state_dict(), "
                f"got {type(obj).__name__}"
            )
        out[name] = PerRank(obj) if per_rank else obj
    return out


def check_same_on_every_rank(states: dict[str, Stateful], state: dict[str, Any]) -> None:
    """A state every rank saves under one key is kept once: it must be the same on every rank,
    or the other ranks' values would be lost. Raises naming the state and how to declare it;
    before that, naming the value, when a state holds one that could not be loaded back."""
    from dcpkit.errors import CheckpointError

    check_storable({name: value for name, value in state.items() if name in states})
    names = [n for n, o in states.items() if n != OPTIMIZER and not isinstance(o, PerRank)]
    differing = differing_states(state, names)
    if differing:
        name, ranks = next(iter(differing.items()))
        raise CheckpointError(
            f"states[{name!r}] differs between ranks (rank 0 and rank "
            f"{', '.join(map(str, ranks))}): a checkpoint keeps one copy of it, so the other "
            f"ranks' values would be lost. Declare it per-rank: CheckpointManager(..., "
            f"per_rank_states={{{name!r}: ...}})"
        )


def differing_states(state: dict[str, Any], names: list[str]) -> dict[str, list[int]]:
    """The states in ``names`` whose value is not the same on every rank: ``{name: ranks whose
    value of a key differs from the first holder's}`` (DCP keeps one rank's copy of a key
    several ranks save)."""
    mine = {name: _fingerprints(state[name]) for name in names if name in state}
    everyone = dist.all_gather_object(mine)
    out: dict[str, list[int]] = {}
    for name in mine:
        first: dict[Any, str] = {}  # each key's value as the first rank that holds it has it
        ranks = []
        for r, theirs in enumerate(everyone):
            prints = theirs.get(name, {})
            if any(first.setdefault(key, fp) != fp for key, fp in prints.items()):
                ranks.append(r)
        if ranks:
            out[name] = ranks
    return out


def _fingerprints(value: Any) -> dict[Any, str]:
    """A state's digests by its top-level key: a key only one rank holds (TorchTitan's
    dataloader keeps each data-parallel rank's position under a key of its own) is written by
    that rank and lost by none; a key several ranks hold must be the same on all of them."""
    if isinstance(value, dict):
        return {key: fingerprint(item) for key, item in value.items()}
    return {None: fingerprint(value)}


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (no pickle): Python's Mersenne
    Twister, NumPy's global generator, torch's CPU generator and every CUDA device's."""
    version, words, gauss = random.getstate()
    _kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python_words": torch.tensor(words, dtype=torch.int64),
        "python_version": int(version),
        "python_gauss": gauss,
        "numpy_keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "numpy_pos": int(pos),
        "numpy_has_gauss": int(has_gauss),
        "numpy_gauss": float(cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        for i, cuda in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda_{i}"] = cuda
    return state


def restore_rng(state: dict[str, Any] | bytes, reseed_offset: int = 0, where: str = "") -> None:
    """Restore what ``capture_rng`` captured (or dcpkit 0.1's pickled RNG blob, read with an
    allow-list); a non-zero ``reseed_offset`` then forks every generator into a new,
    reproducible stream (used for ranks a checkpoint did not have)."""
    if isinstance(state, bytes | bytearray):
        legacy = load_legacy_rng(bytes(state), where or "the checkpoint's RNG state")
        random.setstate(legacy["python"])
        np.random.set_state(legacy["numpy"])
        torch.set_rng_state(legacy["torch"])
        cuda = list(legacy.get("cuda") or [])
    else:
        words = tuple(int(w) for w in state["python_words"].tolist())
        random.setstate((int(state["python_version"]), words, state["python_gauss"]))
        keys = state["numpy_keys"].numpy().astype(np.uint32)
        np.random.set_state(
            (
                "MT19937",
                keys,
                int(state["numpy_pos"]),
                int(state["numpy_has_gauss"]),
                float(state["numpy_gauss"]),
            )
        )
        torch.set_rng_state(state["torch"].to(torch.uint8))
        cuda = [state[k] for k in sorted(k for k in state if k.startswith("cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
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


def rank_key(rank: int) -> str:
    return f"rank_{rank}"
