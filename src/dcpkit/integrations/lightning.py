"""PyTorch Lightning: ``DcpCheckpointIO``, a ``CheckpointIO`` plugin, and ``RNGState``, a
callback.

    Trainer(strategy="ddp", plugins=[DcpCheckpointIO()], callbacks=[RNGState(), ...])

Every checkpoint Lightning writes (``ModelCheckpoint``'s top-k and ``last``, an explicit
``trainer.save_checkpoint``) is then a dcpkit checkpoint folder at the path Lightning chose
(``epoch=1-step=24.ckpt/``): written beside it and published by a rename (a crash leaves the
previous one whole), with a manifest of every file's size and checksum, verified before a load
(``trainer.fit(model, ckpt_path="last")``), never unpickled (values are read with torch's
weights-only loader). To write in the background: under DDP, wrap it in Lightning's
``AsyncCheckpointIO``; under FSDP2 (dcpkit's ``ModelParallelStrategy``), give it
``async_mode="async"`` or ``"async_with_pinned_mem"``: a save then stalls training only for the
copy of each process's shards into staging buffers, and every process's writer writes them on
a process group of its own (as ``CheckpointManager``'s asynchronous saves).
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
import time
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcpkit import dist
from dcpkit.config import ASYNC_MODES
from dcpkit.engine.async_save import AsyncCheckpointer
from dcpkit.engine.load import verify_everywhere
from dcpkit.engine.publish import StepInfo, delete_steps, write_and_publish
from dcpkit.engine.reading import dcp_reader
from dcpkit.engine.states import capture_rng, differing_states, rank_key, restore_rng
from dcpkit.engine.values import check_storable
from dcpkit.errors import CheckpointError, CorruptCheckpoint
from dcpkit.integrations.lightning_layout import (
    LIGHTNING,
    dcp_load,
    decode_keys,
    from_layout,
    move,
    read_whole,
    to_layout,
)
from dcpkit.layout import MODEL, OPTIMIZER
from dcpkit.safe_pickle import safe_load_planner
from dcpkit.storage import open_location

logger = logging.getLogger(__name__)


class DcpCheckpointIO(CheckpointIO):
    """Lightning's checkpoints written, verified and read by dcpkit.

    ``model_prefix``: stripped from the parameter names on save (and put back on load);
    ``hf_model``: ``dcpkit.HFModel("hf", config)`` of a ``transformers`` model inside the
    module, recorded in the manifest so that ``dcpkit to-hf`` exports without being told;
    ``verify_on_load``: check every file's size and checksum before loading (the processes
    split the work); ``storage_options``: fsspec options for ``s3://`` and other URLs;
    ``async_mode`` (under dcpkit's ``ModelParallelStrategy``): ``"async"`` (a writer thread) or
    ``"async_with_pinned_mem"`` (a writer process per rank) saves in the background, training
    blocked only for the staging copy; each save first waits for the one before it, and the
    last is written before ``fit`` returns (its failure raised there, naming the checkpoint).
    """

    def __init__(
        self,
        model_prefix: str = "",
        hf_model: Any = None,
        verify_on_load: bool = True,
        storage_options: dict[str, Any] | None = None,
        retry_s: float = 120.0,
        async_mode: str = "disabled",
    ) -> None:
        if async_mode not in ASYNC_MODES:
            raise ValueError(
                f"DcpCheckpointIO: async_mode {async_mode!r} is not one of {', '.join(ASYNC_MODES)}"
            )
        self.async_mode = async_mode
        self.model_prefix = model_prefix
        self.hf_model = hf_model
        self.verify_on_load = verify_on_load
        self.storage_options = storage_options or {}
        self.retry_s = retry_s

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if self.async_mode != "disabled":
            raise TypeError(
                f"DcpCheckpointIO(async_mode={self.async_mode!r}) saves in the background under "
                "dcpkit's ModelParallelStrategy, where every process writes its shards; here "
                "Lightning's strategy saves from rank 0 alone: wrap the plugin in Lightning's "
                "AsyncCheckpointIO instead (plugins=[AsyncCheckpointIO(DcpCheckpointIO(...))])"
            )
        with dist.this_process_only():  # rank 0 alone, as Lightning calls it
            self.write(checkpoint, path)

    def write(
        self, checkpoint: dict[str, Any], path: Any, background: AsyncCheckpointer | None = None
    ) -> None:
        """Write Lightning's ``checkpoint`` as a dcpkit checkpoint at ``path``: by this process
        alone (``dist.this_process_only``), or by every process of the group together; with
        ``background``, returns once every tensor is copied (its writer does the rest)."""
        store, name = open_location(path, self.storage_options)
        location = store.location(name)
        state = to_layout(checkpoint, self.model_prefix, location)
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
        if background is None:
            write_and_publish(info, state)
            return
        background.save(state, info)  # waits for the save before it, then starts copying
        background.wait_for_staging()

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        store, name, location = self._verified(path)
        start = time.perf_counter()
        with dist.this_process_only(), dist.quiet_single_process():
            state = read_whole(store, name, location)
        checkpoint = from_layout(state, self.model_prefix, location)
        if map_location is not None:
            if not isinstance(map_location, str | torch.device):
                raise TypeError(
                    f"DcpCheckpointIO: map_location must be a device (a str or torch.device), "
                    f"got {type(map_location).__name__}"
                )
            checkpoint = move(checkpoint, torch.device(map_location))
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
            dcp_load(template, reader, safe_load_planner(), location)
        options = StateDictOptions(strict=True)
        set_model_state_dict(module, {prefix + k: v for k, v in model_sd.items()}, options=options)
        for opt, sd in zip(optimizers, template.get(OPTIMIZER, [])):
            set_optimizer_state_dict(module, opt, sd)
        with dist.this_process_only(), dist.quiet_single_process():
            rest = read_whole(store, name, location, only=LIGHTNING)
        checkpoint = decode_keys(rest[LIGHTNING])
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

    With ``DcpCheckpointIO(async_mode=...)`` its saves run in the background (the writer set
    up with the strategy, on every process); ``teardown`` waits for the last one.
    """

    _background: AsyncCheckpointer | None = None
    _writing: str | None = None  # the path of the save in the background, if any

    def setup(self, trainer: Any) -> None:
        io = self._dcp_io()  # before anything trains: a plugin it cannot write through is refused
        super().setup(trainer)
        if io.async_mode != "disabled" and self._background is None:  # every process: a group
            self._background = AsyncCheckpointer(io.async_mode, _retire)

    def _dcp_io(self) -> DcpCheckpointIO:
        io = self.checkpoint_io
        inner = getattr(io, "checkpoint_io", None)
        if isinstance(io, AsyncCheckpointIO) and isinstance(inner, DcpCheckpointIO):
            raise TypeError(
                "dcpkit's ModelParallelStrategy cannot save through AsyncCheckpointIO: a sharded "
                "save is a collective of every process (DCP plans and commits it on the process "
                "group), and AsyncCheckpointIO would run it on a thread of its own beside the "
                "training step's collectives, in an order that differs between processes. Pass "
                'plugins=[DcpCheckpointIO(async_mode="async")] instead: every process copies its '
                "shards and its writer saves them on a process group of its own"
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
        path = self.broadcast(str(filepath))
        self._dcp_io().write(checkpoint, path, self._background)
        if self._background is not None:
            self._writing = path

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        self._drain()
        path = self.broadcast(str(checkpoint_path))
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        return self._dcp_io().load_sharded(path, self.model, optimizers)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            if self._writing is not None and str(filepath) == self._writing:
                self._drain()  # not deleted under its writer
            self._dcp_io().remove_checkpoint(filepath)

    def teardown(self) -> None:
        background, self._background = self._background, None
        try:
            if background is not None:
                background.close()  # the last save written (its failure raised here)
        finally:
            self._writing = None
            super().teardown()

    def _drain(self) -> None:
        if self._background is not None:
            self._background.wait()
            self._writing = None


def _retire(store: Any, steps: list[int]) -> None:
    delete_steps(store, steps)  # retention is ModelCheckpoint's: none reach here


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
