"""PyTorch Lightning: ``DcpCheckpointIO``, a ``CheckpointIO`` plugin, and ``RNGState``, a
callback.

    Trainer(strategy="ddp", plugins=[DcpCheckpointIO()], callbacks=[RNGState(), ...])

Every checkpoint Lightning writes (``ModelCheckpoint``'s top-k and ``last``, an explicit
``trainer.save_checkpoint``) is then a dcpkit checkpoint folder at the path Lightning chose
(``epoch=1-step=24.ckpt/``): written beside it and published by a rename (a crash leaves the
previous one whole), with a manifest of every file's size and checksum, verified before a load
(``trainer.fit(model, ckpt_path="last")``), never unpickled (values are read with torch's
weights-only loader). Wrap it in Lightning's ``AsyncCheckpointIO`` to write in the background
(DDP; not under ``ModelParallelStrategy``, which refuses it).
``lightning_loading.load_from_checkpoint`` (or its ``LoadsDcpCheckpoints`` mixin) builds a
module from a checkpoint, as Lightning's own method does.

Layout: the LightningModule's parameters at the top level, named as in the module without
``model_prefix`` (``"model."`` for a module that holds a ``transformers`` model as
``self.model``: its keys are then the model's own, which ``dcpkit to-hf`` exports), and
everything else Lightning keeps (optimizer and scheduler states, loops, callbacks, epoch,
global step, hyperparameters) under ``lightning``.

Lightning saves a replicated strategy's checkpoint (DDP, single device) from global rank 0
only, the other processes not taking part: the checkpoint is written by that process alone
and loads at any world size. Lightning itself does not checkpoint the RNG states; ``RNGState``
keeps every process's (Python, NumPy, torch), so that dropout after a resume draws what it
would have drawn. Lightning restores a checkpoint written at the end of an epoch, or at its last
batch (``every_n_train_steps``), exactly; one written mid-epoch restarts the epoch's data
(Lightning's own behaviour, which it warns of).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcpkit import dist
from dcpkit.engine.load import verify_everywhere
from dcpkit.engine.publish import StepInfo, write_and_publish
from dcpkit.engine.reading import dcp_reader, load_failure
from dcpkit.engine.states import capture_rng, differing_states, rank_key, restore_rng
from dcpkit.engine.values import check_storable
from dcpkit.errors import CheckpointError, CorruptCheckpoint
from dcpkit.layout import MODEL, OPTIMIZER
from dcpkit.safe_pickle import safe_load_planner
from dcpkit.storage import open_location

logger = logging.getLogger(__name__)

LIGHTNING = "lightning"
"""The top-level group holding everything of Lightning's checkpoint besides the parameters."""


class DcpCheckpointIO(CheckpointIO):
    """Lightning's checkpoints written, verified and read by dcpkit.

    ``model_prefix``: stripped from the parameter names on save (and put back on load);
    ``hf_model``: ``dcpkit.HFModel("hf", config)`` of a ``transformers`` model inside the
    module, recorded in the manifest so that ``dcpkit to-hf`` exports without being told;
    ``verify_on_load``: check every file's size and checksum before loading (the processes
    split the work); ``storage_options``: fsspec options for ``s3://`` and other URLs.
    """

    def __init__(
        self,
        model_prefix: str = "",
        hf_model: Any = None,
        verify_on_load: bool = True,
        storage_options: dict[str, Any] | None = None,
        retry_s: float = 120.0,
    ) -> None:
        self.model_prefix = model_prefix
        self.hf_model = hf_model
        self.verify_on_load = verify_on_load
        self.storage_options = storage_options or {}
        self.retry_s = retry_s

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        with dist.this_process_only():  # rank 0 alone, as Lightning calls it
            self.write(checkpoint, path)

    def write(self, checkpoint: dict[str, Any], path: Any) -> None:
        """Write Lightning's ``checkpoint`` as a dcpkit checkpoint at ``path``: by this process
        alone (``dist.this_process_only``), or by every process of the group together."""
        store, name = open_location(path, self.storage_options)
        location = store.location(name)
        state = _to_layout(checkpoint, self.model_prefix, location)
        check_storable({LIGHTNING: state[LIGHTNING]})
        differing = differing_states(state, [LIGHTNING])  # one copy is kept: the same everywhere
        if differing:
            ranks = ", ".join(map(str, differing[LIGHTNING]))
            raise CheckpointError(
                f"{location}: Lightning's checkpoint state (loops, callbacks, ...) differs "
                f"between rank 0 and rank {ranks}: one copy is kept, the others' would be lost"
            )
        info = StepInfo(
            store=store,
            step=int(checkpoint.get("global_step", 0)),
            groups=[MODEL, *([OPTIMIZER] if OPTIMIZER in state else []), LIGHTNING],
            keep_latest_k=0,  # ModelCheckpoint chooses what to keep
            retry_s=self.retry_s,
            model=self.hf_model.record() if hasattr(self.hf_model, "record") else None,
            name=name,
        )
        write_and_publish(info, state)

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        store, name, location = self._verified(path)
        start = time.perf_counter()
        with dist.this_process_only(), dist.quiet_single_process():
            state = _read_whole(store, name, location)
        checkpoint = _from_layout(state, self.model_prefix, location)
        if map_location is not None:
            if not isinstance(map_location, str | torch.device):
                raise TypeError(
                    f"DcpCheckpointIO: map_location must be a device (a str or torch.device), "
                    f"got {type(map_location).__name__}"
                )
            checkpoint = _move(checkpoint, torch.device(map_location))
        logger.info("checkpoint: loaded %s in %.2fs", location, time.perf_counter() - start)
        return checkpoint

    def load_sharded(self, path: Any, module: Any, optimizers: list[Any]) -> dict[str, Any]:
        """Every process restores its shards of ``module`` and ``optimizers`` (DTensors, at any
        world size) from ``path``; returns Lightning's checkpoint around them."""
        store, name, location = self._verified(path)
        prefix = self.model_prefix
        model_sd = {
            k.removeprefix(prefix): v
            for k, v in get_model_state_dict(module).items()
            if k.startswith(prefix)
        }
        reader, _ = dcp_reader(store, name)
        saved = reader.read_metadata().state_dict_metadata
        with_optimizers = any(k.split(".")[0] == OPTIMIZER for k in saved)  # not weights-only
        template: dict[str, Any] = dict(model_sd)
        if with_optimizers:
            template[OPTIMIZER] = [get_optimizer_state_dict(module, opt) for opt in optimizers]
        with dist.quiet_single_process():  # each process plans and reads its own shards
            _dcp_load(template, reader, safe_load_planner(), location)
        options = StateDictOptions(strict=True)
        set_model_state_dict(module, {prefix + k: v for k, v in model_sd.items()}, options=options)
        for opt, sd in zip(optimizers, template.get(OPTIMIZER, [])):
            set_optimizer_state_dict(module, opt, sd)
        with dist.this_process_only(), dist.quiet_single_process():
            rest = _read_whole(store, name, location, only=LIGHTNING)
        checkpoint = _decode_keys(rest[LIGHTNING])
        checkpoint["state_dict"] = {prefix + k: v for k, v in model_sd.items()}
        if with_optimizers:
            checkpoint["optimizer_states"] = template[OPTIMIZER]
        return checkpoint

    def _verified(self, path: Any) -> tuple[Any, str, str]:
        store, name = open_location(path, self.storage_options)
        location = store.location(name)
        if not store.holds_checkpoint(name):
            raise CheckpointError(f"{location} is not a published checkpoint")
        if self.verify_on_load:  # every process that loads: they split the checksums
            problems = verify_everywhere(store, name, require_commit=False)
            if problems:
                raise CorruptCheckpoint(f"{location} failed verification: {'; '.join(problems)}")
        return store, name, location

    def remove_checkpoint(self, path: Any) -> None:
        store, name = open_location(path, self.storage_options)
        store.delete(name)


class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2 and tensor parallelism, DTensors), whose
    sharded checkpoints every process writes and reads through the ``DcpCheckpointIO`` given in
    ``plugins`` (Lightning's own strategy writes them with DCP directly, bypassing any
    ``CheckpointIO``)::

        Trainer(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                plugins=[DcpCheckpointIO(...)])
    """

    def setup(self, trainer: Any) -> None:
        self._dcp_io()  # before anything trains: a plugin it cannot write through is refused
        super().setup(trainer)

    def _dcp_io(self) -> DcpCheckpointIO:
        io = self.checkpoint_io
        inner = getattr(io, "checkpoint_io", None)
        if isinstance(io, AsyncCheckpointIO) and isinstance(inner, DcpCheckpointIO):
            raise TypeError(
                "dcpkit's ModelParallelStrategy cannot save through AsyncCheckpointIO: a sharded "
                "save is a collective of every process (DCP plans and commits it on the process "
                "group), and AsyncCheckpointIO would run it on a thread of its own beside the "
                "training step's collectives, in an order that differs between processes. Pass "
                "plugins=[DcpCheckpointIO(...)] alone (saves then block training while they "
                "write); AsyncCheckpointIO works with DDP, where rank 0 writes alone"
            )
        if not isinstance(io, DcpCheckpointIO):
            raise TypeError(
                "dcpkit's ModelParallelStrategy writes through DcpCheckpointIO: pass "
                f"plugins=[DcpCheckpointIO(...)] to the Trainer (it has {type(io).__name__})"
            )
        return io

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        self._dcp_io().write(checkpoint, self.broadcast(str(filepath)))

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        path = self.broadcast(str(checkpoint_path))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        return self._dcp_io().load_sharded(path, self.model, optimizers)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            self._dcp_io().remove_checkpoint(filepath)


class RNGState(Callback):
    """Every process's RNG states (Python, NumPy, torch, CUDA) in the checkpoint, restored on
    resume: Lightning keeps none, so dropout after a resume would differ without it."""

    @property
    def state_key(self) -> str:
        return "dcpkit.RNGState"

    def state_dict(self) -> dict[str, Any]:
        everyone = dist.all_gather_object(capture_rng())  # every process calls this
        return {rank_key(rank): state for rank, state in enumerate(everyone)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = rank_key(dist.rank())
        if key not in state_dict:
            raise CheckpointError(
                f"the checkpoint holds the RNG states of {len(state_dict)} processes, not of "
                f"process {dist.rank()}: it was saved at a smaller world size. Remove RNGState "
                "from the callbacks to resume with fresh RNG streams"
            )
        restore_rng(state_dict[key], where="the checkpoint's RNGState")


def _to_layout(checkpoint: dict[str, Any], prefix: str, location: str) -> dict[str, Any]:
    params = checkpoint.get("state_dict", {})
    outside = [k for k in params if not k.startswith(prefix)]
    if outside:
        raise CheckpointError(
            f"{location}: parameters {', '.join(outside[:4])} do not start with model_prefix "
            f"{prefix!r}: they would not be found again"
        )
    state: dict[str, Any] = {k.removeprefix(prefix): v for k, v in params.items()}
    clash = [k for k in state if k.split(".")[0] in (LIGHTNING, OPTIMIZER)]
    if clash:
        raise CheckpointError(f"{location}: parameter {clash[0]!r} takes a reserved name")
    if "optimizer_states" in checkpoint:  # not a weights-only checkpoint
        optimizers = list(checkpoint["optimizer_states"])
        state[OPTIMIZER] = _encode_keys(optimizers, location, OPTIMIZER)
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    state[LIGHTNING] = _encode_keys(rest, location, LIGHTNING)
    return state


_INT_KEY = "int:"


def _encode_keys(obj: Any, location: str, where: str) -> Any:
    """DCP names every saved value by its path of dict keys, as text: an optimizer's state,
    keyed by parameter index (0, 1, ...), would come back keyed "0", "1", ... and torch's
    ``load_state_dict`` would keep it beside fresh state instead of restoring it. Integer keys
    are saved as ``int:N`` and read back as N; other keys must be text."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if type(key) is int:
                name = f"{_INT_KEY}{key}"
            elif type(key) is str and not key.startswith(_INT_KEY):
                name = key
            else:
                raise CheckpointError(
                    f"{location}: {where} has the key {key!r}: keys must be text (not starting "
                    f"with {_INT_KEY!r}) or integers"
                )
            out[name] = _encode_keys(value, location, f"{where}.{key}")
        return out
    if isinstance(obj, list | tuple):
        items = [_encode_keys(v, location, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _decode_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            (int(k[len(_INT_KEY) :]) if k.startswith(_INT_KEY) else k): _decode_keys(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_decode_keys(v) for v in obj]
    return obj


def _from_layout(state: dict[str, Any], prefix: str, location: str) -> dict[str, Any]:
    if LIGHTNING not in state:
        raise CheckpointError(f"{location} is not a Lightning checkpoint written by dcpkit")
    checkpoint = _decode_keys(state.pop(LIGHTNING))
    if OPTIMIZER in state:
        checkpoint["optimizer_states"] = _decode_keys(state.pop(OPTIMIZER))
    checkpoint["state_dict"] = {prefix + k: v for k, v in state.items()}
    return checkpoint


def _read_whole(store: Any, name: str, location: str, only: str | None = None) -> dict[str, Any]:
    """Checkpoint ``name`` read whole (or its group ``only``) into a new dict (a dict of dicts,
    as saved), its tensors bound first by the bytes its data files really hold."""
    reader, _ = dcp_reader(store, name)
    metadata = reader.read_metadata()
    stored = sum(store.size(f"{name}/{n}") for n in store.list_names(name) if n.endswith(".distcp"))
    sizes = {
        fqn: md.properties.dtype.itemsize * math.prod(int(d) for d in md.size)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    negative = next(
        (
            fqn
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and any(int(d) < 0 for d in md.size)
        ),
        None,
    )
    if negative is not None:
        shape = list(metadata.state_dict_metadata[negative].size)
        raise CorruptCheckpoint(f"{location}/.metadata: {negative}: negative size {shape}")
    wanted = sum(sizes.values())
    if wanted > stored:
        largest = max(sizes, key=sizes.__getitem__)
        raise CorruptCheckpoint(
            f"{location}/.metadata: {largest}: its tensors claim {wanted} bytes ({largest} "
            f"{sizes[largest]}) but its data files hold {stored}: damaged or not a checkpoint"
        )
    planner = safe_load_planner(everything=True, keys=None if only is None else {only})
    _dcp_load({}, reader, planner, location)
    return planner.original_state_dict  # dcp.load fills a dict of its own, the planner's


def _dcp_load(template: dict[str, Any], reader: Any, planner: Any, location: str) -> None:
    """``dcp.load``, its failure one error naming the checkpoint (never DCP's traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcpkit.safe_pickle import UnsafeCheckpoint

    try:
        dcp.load(template, storage_reader=reader, planner=planner, no_dist=True)
    except (CheckpointException, UnsafeCheckpoint) as e:
        raise load_failure(e, location) from None


def _move(obj: Any, where: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(where)
    if isinstance(obj, dict):
        return {k: _move(v, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_move(v, where) for v in obj]
    return obj
