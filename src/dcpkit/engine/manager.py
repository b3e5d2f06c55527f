"""``CheckpointManager``: the facade a training loop talks to. It decides nothing itself: the
store says where checkpoints live (``dcpkit.storage``), the policy when to save and what to load
(``policy``), and ``load`` / ``restore`` / ``save`` do the work.

Save path: states collected (DTensors stay sharded) -> DCP writes a pending step -> each rank
checksums its files -> rank 0 writes the manifest, publishes ``step-N`` -> old steps are deleted
in the background (not those readers hold). Load path: the latest published step (or
``load_step``) -> verified -> a template of the state -> ``dcp.load`` reshards into it."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from dcpkit import dist
from dcpkit.config import CheckpointConfig
from dcpkit.console import summary
from dcpkit.engine import load as load_plan
from dcpkit.engine import save as saving
from dcpkit.engine.folders import check_folders, check_unused
from dcpkit.engine.lease import check_free, check_lease, release_folder, take_lease
from dcpkit.engine.memory_tier import MemoryTier
from dcpkit.engine.policy import should_save
from dcpkit.engine.preempt import Preemption
from dcpkit.engine.publish import StepInfo, write_and_publish
from dcpkit.engine.restore import HFCodec, restore
from dcpkit.engine.states import ModelState, Stateful, check_same_on_every_rank, collect_states
from dcpkit.engine.together import read_held
from dcpkit.errors import CheckpointError
from dcpkit.layout import MODEL, RNG, step_name
from dcpkit.storage import StoreError, open_store

logger = logging.getLogger(__name__)


class CheckpointManager:
    """Saves and restores all training state; usable by any PyTorch trainer.

    Call order: ``load()`` once before training; each step ``maybe_wait_for_staging()`` before
    ``optimizer.step()`` and ``save(step, last_step=...)`` after it; ``close()`` at the end (or use
    the manager as a context manager).
    """

    def __init__(
        self,
        config: CheckpointConfig,
        base_folder: str | Path,
        model: nn.Module | Sequence[nn.Module],
        optimizer: Any = None,
        lr_scheduler: Any = None,
        dataloader: Stateful | None = None,
        states: dict[str, Stateful] | None = None,
        save_rng: bool = True,
        hf_model: HFCodec | None = None,
        per_rank_states: dict[str, Stateful] | None = None,
    ) -> None:
        self.config = config
        self.hf_model = hf_model
        self.store = open_store(config.folder, config.storage_options, base=base_folder)
        self.folder = self.store.root
        self.model = ModelState(model)
        self.states = collect_states(
            model, optimizer, lr_scheduler, dataloader, states, per_rank_states
        )
        self.save_rng = save_rng
        saving.check_config(config, self.state_names(), hf_model, self.model)
        self.rank, self.world_size = dist.rank(), dist.world_size()
        self.last_saved_step: int | None = None
        self.loaded_step: int | None = None
        self.best_step: int | None = None  # kept by retention beside the newest (``policy``)
        self._resumed_from: int | None = None  # a full load of this folder's step: see save()
        writes = config.enable and not config.load_only
        self._check_use = writes  # a save before any load(): the folder must hold no later step
        check_folders(config, base_folder, self.folder)  # or say that checkpointing is off
        if config.enable:
            load_plan.check_reachable(self.store)
        if writes:  # a folder in use by another live run: stop now, before anything is written
            check_free(self.store, config.lease_timeout_s, owner=self)
        self._lease: Any = None
        self._leased = False  # taken at the first save
        # The lease is ours: leftovers are dead runs'. Rank 0 removes them; all fail with it.
        failed = dist.first_rank_error(
            self.store.remove_incomplete if writes else list, (OSError, StoreError)
        )
        if failed:
            raise CheckpointError(f"{self.folder}: removing what interrupted saves left: {failed}")
        self._saver = saving.Saver(config.async_mode) if writes else None
        self._async = self._saver.async_ckpt if self._saver is not None else None
        self._preempt = (
            Preemption(config.emergency_timeout_s) if writes and config.emergency_save else None
        )
        self._memory = MemoryTier(config, self.folder) if writes and config.local_interval else None
        self.last_memory_step: int | None = None

    def state_names(self) -> list[str]:
        return [MODEL, *self.states, *([RNG] if self.save_rng else [])]

    def published_steps(self) -> list[int]:
        """Steps of the published checkpoints in the checkpoint folder, ascending."""
        return self.store.published_steps()

    def step_path(self, step: int) -> str:
        return self.store.location(step_name(step))

    @dist.paused_gc()
    def load(self) -> int | None:
        """Restore the latest published checkpoint (or ``load_step``). Returns its step, or None
        when there is nothing to load and training starts fresh."""
        if not self.config.enable:
            return None
        self._check_use = False
        plan = load_plan.plan_everywhere(self.config, self.store, self.states)
        plan.raise_if_failed()
        if self._memory is not None and self.config.load_step == -1:
            step = self._memory.load(plan.step, plan.name, self._restore)
            if step is not None:
                self.loaded_step = self._resumed_from = step
                return step
        if plan.name is None:
            summary(logger, f"checkpoint: {plan.reason}")
            return None
        start = time.perf_counter()
        read: dict[str, Any] = {}  # what the load read by (its index)
        restore = functools.partial(self._restore, seen=read)
        plan, loaded = load_plan.restore_verified(plan, self.config, self.store, restore)
        seconds, pieces = time.perf_counter() - start, ", ".join(loaded)
        summary(
            logger,
            f"checkpoint: loaded {plan.location} ({plan.reason}; {pieces}) in {seconds:.2f}s",
        )
        self.loaded_step = plan.step
        self._resumed_from = plan.step if plan.own and not plan.model_only else None
        if self._saver is not None and self._resumed_from is not None:  # its plans, for a save
            self._saver.resumed(read, plan.step)
        return plan.step

    def load_from(
        self, path: str | Path, model_only: bool = False, step: int | str | None = None
    ) -> list[str]:
        """Load the checkpoint at ``path`` (a folder or a URL; with ``step``, a number or
        ``latest``, a checkpoint folder) into the current state, at any world size, held against
        that run's retention meanwhile. Returns the names of the state pieces restored."""
        restore_it = functools.partial(self._restore, model_only=model_only)
        return read_held(path, step, self.config, "load", restore_it)

    @dist.paused_gc()
    def _restore(  # reader: checksums, metadata, index, seen (see restore())
        self, store: Any, name: str, model_only: bool, own_rank: bool = False, **reader: Any
    ) -> list[str]:
        return restore(
            store,
            name,
            self.model,
            self.states,
            model_only=model_only,
            excluded=self.config.exclude_from_loading,
            rng=self.save_rng,
            hf=self.hf_model,
            own_rank=own_rank,
            **reader,
        )

    def verify(self, path: str | Path, step: int | str | None = None) -> list[str]:
        """Problems with the checkpoint at ``path`` (ranks split the checksums); empty if intact."""
        check = functools.partial(load_plan.verify_everywhere, require_commit=False)
        return read_held(path, step, self.config, "verify", check)

    def should_save(self, step: int, last_step: bool = False, force: bool = False) -> bool:
        cfg = self.config
        return should_save(
            step,
            interval=cfg.interval,
            enabled=cfg.enable,
            load_only=cfg.load_only,
            first_step=cfg.enable_first_step_checkpoint,
            last_step=last_step,
            force=force,
            last_saved_step=self.last_saved_step,
        )

    def maybe_wait_for_staging(self) -> None:
        """Block until the state being staged for a save may be modified: call it before
        ``optimizer.step()``. Only an asynchronous save's memory copy is waited for."""
        if self._saver is not None:
            self._saver.wait_for_staging()

    def preempted(self) -> bool:
        """With ``emergency_save``: whether SIGTERM reached any rank. A collective: call it on
        every rank after every step; when True, ``save(step, force=True)``, ``close()``, exit
        with ``EXIT_PREEMPTED``."""
        return self._preempt is not None and self._preempt.agreed()

    @dist.paused_gc()
    def save(self, step: int, last_step: bool = False, force: bool = False) -> bool:
        """Save at ``step`` if the policy says so (or ``force``). Returns whether it saved."""
        self._check_use = self._check_use and check_unused(self._step_info(step, False))
        if self._saver is None or not self.should_save(step, last_step, force):
            if self._memory is not None and self._memory.due(step):
                state = self.collect()
                self._memory.save(step, state, self.state_names(), saving.mesh_info(self.model))
                self.last_memory_step = step
            return False
        if not self._leased:  # every rank: rank 0 holds the lease, the others know it is held
            self._lease = take_lease(self.store, self.config.lease_timeout_s, owner=self)
            self._leased = True
        check_lease(self._lease)
        model_only = last_step and self.config.last_save_model_only
        info = self._step_info(step, model_only)
        saving.check_replacement(info, self._resumed_from)
        state = self.collect(model_only=model_only)
        if not model_only:  # every value loadable, and the same on every rank unless per-rank
            check_same_on_every_rank(self.states, state)
        info.frozen = saving.frozen_entries(self.model, state, self.config.link_frozen)
        start = time.perf_counter()
        if self._saver.async_ckpt is not None and not (last_step or force):
            self._saver.save_async(state, info)
            self.last_saved_step = step
            seconds, mode = time.perf_counter() - start, self.config.async_mode
            summary(logger, f"checkpoint: step {step} staging ({mode}), written in the background; "
                    f"{seconds:.3f}s in save()")  # fmt: skip
            return True
        hf = self.hf_model if model_only and self.config.last_save_in_hf else None
        self._saver.save_sync(state, info, hf)
        self.last_saved_step = step
        what = f" (model only, {self.config.export_dtype})" if model_only else ""
        seconds, checksum_s = time.perf_counter() - start, self._saver.last_checksum_s
        summary(logger, f"checkpoint: saved step {step}{what} to {self.step_path(step)} in "
                f"{seconds:.2f}s (checksums {checksum_s:.3f}s)")  # fmt: skip
        return True

    @property
    def last_checksum_s(self) -> float:  # seconds the last synchronous save spent checksumming
        return self._saver.last_checksum_s if self._saver else 0.0

    @property
    def global_plans(self) -> int:  # DCP global plannings this rank ran (cached saves run none)
        return self._saver.global_plans() if self._saver else 0

    def save_seed_checkpoint(self) -> Path:
        """Save the model alone as step 0 (``create_seed_checkpoint``), in its own dtype."""
        state = saving.collect(self.model, {}, rng=False, model_only=True)
        write_and_publish(self._step_info(0, model_only=True), state)
        self.last_saved_step = 0
        return Path(self.step_path(0))

    def collect(self, model_only: bool = False) -> dict[str, Any]:
        """The state dict to write, in TorchTitan's top-level layout."""
        dtype, rng = self.config.export_dtype, self.save_rng
        return saving.collect(self.model, self.states, rng=rng, model_only=model_only, dtype=dtype)

    def _step_info(self, step: int, model_only: bool) -> StepInfo:
        return StepInfo(
            store=self.store,
            step=step,
            groups=[MODEL] if model_only else self.state_names(),
            keep_latest_k=self.config.keep_latest_k,
            dtype=self.config.export_dtype if model_only else None,
            mesh=saving.mesh_info(self.model),
            retry_s=self.config.storage_retry_s,
            previous=self.last_saved_step,
            model=self.hf_model.record() if hasattr(self.hf_model, "record") else None,
            best=self.best_step,
        )

    def wait(self) -> None:
        """Block until every save is written (durable, or in the memory tier and replicated) and
        old steps deleted (raising a save's error)."""
        if self._saver is not None:
            self._saver.wait()
            self._saver.wait_for_deletions()
        if self._memory is not None:
            self._memory.wait()

    def close(self) -> None:
        """Drain pending asynchronous saves (raising their errors) and stop the writer."""
        if self._saver is not None:
            saver, self._saver, self._async = self._saver, None, None
            try:
                saver.close()
            finally:
                release_folder(self.store, self)
                if self._lease is not None:
                    self._lease.release()
                if self._preempt is not None:
                    self._preempt.close()
                if self._memory is not None:
                    self._memory.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
