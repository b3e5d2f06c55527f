"""``CheckpointManager``: when to save, what to load. The how lives in layout, states, integrity.

Save path: states collected (DTensors stay sharded) -> DCP writes ``.tmp-step-N`` -> every rank
checksums its own files -> rank 0 writes the manifest and publishes ``step-N`` -> retention.
Load path: the latest published step (or ``load_step``) -> a template of the current state ->
``dcp.load`` reshards into it -> each piece restores itself.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from dcpkit import dist, layout
from dcpkit.config import CheckpointConfig, ConfigError
from dcpkit.integrity import build_manifest, data_files, describe_files, write_manifest
from dcpkit.publish import StepInfo, StepWriter, write_and_publish
from dcpkit.remote import Remote, RemoteError, is_url, verify_remote, verify_url
from dcpkit.staging import AsyncCheckpointer
from dcpkit.states import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    RNG,
    ModelState,
    OptimizerState,
    SchedulerState,
    Stateful,
    capture_rng,
    restore_rng,
    rng_key,
    rng_source_rank,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which one and why."""


@dataclass
class HFModel:
    """What Hugging Face I/O needs to know about the model: family, args, tokenizer to ship."""

    family: str
    args: Any
    tokenizer: str | None = None


@dataclass
class LoadPlan:
    path: str | None
    step: int | None
    model_only: bool
    reason: str
    error: str | None = None

    @classmethod
    def failed(cls, error: str) -> LoadPlan:
        return cls(None, None, False, "", error=error)


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
        hf_model: HFModel | None = None,
    ) -> None:
        self.config = config
        self.hf_model = hf_model
        folder = Path(config.folder)
        self.remote: Remote | None = None
        if is_url(config.folder):
            self.remote = Remote(config.folder, config.storage_options)
            self.folder: Any = self.remote.url
        else:
            self.folder = folder if folder.is_absolute() else Path(base_folder) / folder
        self.model = ModelState(model)
        self.states: dict[str, Stateful] = {}
        if optimizer is not None:
            self.states[OPTIMIZER] = OptimizerState(model, optimizer)
        if lr_scheduler is not None:
            self.states[LR_SCHEDULER] = SchedulerState(lr_scheduler)
        if dataloader is not None:
            self.states[DATALOADER] = dataloader
        for name, obj in (states or {}).items():
            if name in self.states or name in (MODEL, RNG):
                raise ValueError(f"state name {name!r} is reserved by CheckpointManager")
            if not isinstance(obj, Stateful):
                raise TypeError(
                    f"states[{name!r}] must have state_dict() and load_state_dict(), "
                    f"got {type(obj).__name__}"
                )
            self.states[name] = obj
        self.save_rng = save_rng
        self._check_config()
        self.rank = dist.rank()
        self.world_size = dist.world_size()
        self.last_saved_step: int | None = None
        self.last_checksum_s = 0.0
        self.loaded_step: int | None = None
        if self.remote is not None and self.config.enable:
            self._check_remote()
        if self.config.enable and not self.config.load_only and self.rank == 0:
            if self.remote is not None:
                self.remote.remove_abandoned()
            else:
                layout.clean_leftovers(self.folder)
        dist.barrier()
        self._async: AsyncCheckpointer | None = None
        if self.config.enable and not self.config.load_only and config.async_mode != "disabled":
            self._async = AsyncCheckpointer(config.async_mode)

    # ------------------------------------------------------------------ configuration

    def state_names(self) -> list[str]:
        names = [MODEL, *self.states]
        if self.save_rng:
            names.append(RNG)
        return names

    def _check_config(self) -> None:
        cfg = self.config
        unknown = sorted(set(cfg.exclude_from_loading) - set(self.state_names()))
        if unknown:
            raise ConfigError(
                f"[checkpoint] exclude_from_loading names {', '.join(map(repr, unknown))}, which "
                f"this run does not checkpoint; known state keys: {', '.join(self.state_names())}"
            )
        if (cfg.initial_load_in_hf or cfg.last_save_in_hf) and self.hf_model is None:
            raise ConfigError(
                "[checkpoint] initial_load_in_hf / last_save_in_hf need to know the model family: "
                "pass hf_model=HFModel(family, flavor_args) to CheckpointManager"
            )

    # ------------------------------------------------------------------ load

    def _check_remote(self) -> None:
        assert self.remote is not None
        error = None
        if self.rank == 0:
            try:
                self.remote.check_reachable()
            except RemoteError as e:
                error = str(e)
        error = dist.broadcast_object(error)
        if error:
            raise CheckpointError(f"[checkpoint] folder {error}")
        if self.config.last_save_in_hf:
            raise ConfigError(
                "[checkpoint] last_save_in_hf works with a local folder only; "
                f"{self.remote.url} is remote: save DCP there and convert with `dcpkit to-hf`"
            )

    def published_steps(self) -> list[int]:
        """Steps of the published checkpoints in the checkpoint folder, ascending."""
        if self.remote is not None:
            return self.remote.published_steps()
        return layout.published_steps(self.folder)

    def step_path(self, step: int) -> str:
        if self.remote is not None:
            return self.remote.child(f"step-{step}")
        return str(layout.step_dir(self.folder, step))

    def _plan_load(self) -> LoadPlan:
        cfg = self.config
        steps = self.published_steps()
        if cfg.load_step != -1:
            if cfg.load_step not in steps:
                have = ", ".join(map(str, steps)) or "none"
                return LoadPlan.failed(
                    (
                        f"[checkpoint] load_step = {cfg.load_step}, but {self.folder} has no "
                        f"published checkpoint step-{cfg.load_step} (published steps: {have}); "
                        "set load_step "
                        "to one of them, or to -1 for the latest"
                    ),
                )
            return LoadPlan(
                self.step_path(cfg.load_step),
                cfg.load_step,
                cfg.load_step == 0,
                f"load_step = {cfg.load_step}",
            )
        if steps:
            why = f"latest published step in {self.folder}"
            if cfg.initial_load_path:
                why += " (initial_load_path is ignored: the checkpoint folder is not empty)"
            # Step 0 is a seed checkpoint: the model only (TorchTitan's rule).
            return LoadPlan(self.step_path(steps[-1]), steps[-1], steps[-1] == 0, why)
        if cfg.initial_load_path and is_url(cfg.initial_load_path):
            return self._plan_remote_initial_load(cfg.initial_load_path)
        if cfg.initial_load_path:
            path = Path(cfg.initial_load_path)
            if cfg.initial_load_in_hf and not layout.is_hf(path):
                return LoadPlan.failed(
                    (
                        f"[checkpoint] initial_load_path {str(path)!r} holds no Hugging Face "
                        "safetensors (model.safetensors or model.safetensors.index.json), and "
                        "initial_load_in_hf = true"
                    ),
                )
            if not cfg.initial_load_in_hf and not (path / layout.METADATA).is_file():
                return LoadPlan.failed(
                    (
                        f"[checkpoint] initial_load_path {str(path)!r} is not a checkpoint (no "
                        f"{layout.METADATA} in it); point it at a step-N folder"
                    ),
                )
            return LoadPlan(
                str(path),
                None,
                cfg.initial_load_model_only,
                "initial_load_path (the checkpoint folder is empty)",
            )
        return LoadPlan(None, None, False, f"no checkpoint in {self.folder}: starting fresh")

    def _plan_remote_initial_load(self, url: str) -> LoadPlan:
        """``initial_load_path`` on an object store: a DCP step folder, or with
        ``initial_load_in_hf`` a Hugging Face folder (read in place, never downloaded whole)."""
        cfg = self.config
        try:
            remote = Remote(url, cfg.storage_options)
            remote.check_reachable()
            names = set(remote.ls_names())
        except RemoteError as e:
            return LoadPlan.failed(f"[checkpoint] initial_load_path {e}")
        if cfg.initial_load_in_hf and not names & layout.HF_FILES:
            return LoadPlan.failed(
                f"[checkpoint] initial_load_path {url!r} holds no Hugging Face safetensors "
                f"(model.safetensors or {layout.HF_INDEX}), and initial_load_in_hf = true"
            )
        if not cfg.initial_load_in_hf and layout.METADATA not in names:
            return LoadPlan.failed(
                f"[checkpoint] initial_load_path {url!r} is not a checkpoint (no "
                f"{layout.METADATA} in it); point it at a step-N folder"
            )
        return LoadPlan(
            remote.url,
            None,
            cfg.initial_load_model_only,
            "initial_load_path (the checkpoint folder is empty)",
        )

    def load(self) -> int | None:
        """Restore the latest published checkpoint (or ``load_step``). Returns its step, or None
        when there is nothing to load and training starts fresh."""
        if not self.config.enable:
            return None
        plan = dist.broadcast_object(self._plan_load() if self.rank == 0 else None)
        if plan.error:
            raise ConfigError(plan.error)
        if plan.path is None:
            logger.info("checkpoint: %s", plan.reason)
            return None
        if self.config.verify_on_load:
            plan = self._verified(plan)
        start = time.perf_counter()
        loaded = self.load_from(plan.path, model_only=plan.model_only)
        logger.info(
            "checkpoint: loaded %s (%s; %s) in %.2fs",
            plan.path,
            plan.reason,
            ", ".join(loaded),
            time.perf_counter() - start,
        )
        self.loaded_step = plan.step
        return plan.step

    def verify(self, path: str | Path) -> list[str]:
        """Problems with the checkpoint at ``path`` (sizes, checksums, structure); every rank
        checksums its share of the files. Empty when it is intact."""
        from dcpkit.integrity import load_manifest
        from dcpkit.verify import verify_path

        if is_url(path) and not self._in_folder(path):
            # Not one of this run's step folders (an initial_load_path): no commit marker is
            # expected, and a checkpoint that dcpkit did not write has no checksums to check.
            problems = []
            if self.rank == 0:
                report = verify_url(str(path), storage_options=self.config.storage_options)
                problems = [str(p) for p in report.problems]
        elif is_url(path):
            remote = Remote(str(path).rsplit("/", 1)[0], self.config.storage_options)
            name = str(path).rstrip("/").rsplit("/", 1)[-1]
            files = remote.ls_names(name)
            mine = files[self.rank :: self.world_size]
            problems = [str(p) for p in verify_remote(remote, name, mine)]
        else:
            manifest, _ = load_manifest(Path(path))
            names = sorted(manifest["files"]) if manifest else []
            mine = names[self.rank :: self.world_size] if manifest else None
            problems = [str(p) for p in verify_path(path, checksum_files=mine).problems]
        found: set[str] = set()
        for part in dist.all_gather_object(problems):
            found.update(part)
        return sorted(found)

    def _in_folder(self, url: str | Path) -> bool:
        return self.remote is not None and str(url).rstrip("/").rsplit("/", 1)[0] == self.remote.url

    def _verified(self, plan: LoadPlan) -> LoadPlan:
        """``plan`` if its checkpoint verifies; else the newest older one that does, when
        ``fallback_on_corruption`` allows it; else an error listing the problems."""
        assert plan.path is not None
        problems = self.verify(plan.path)
        if not problems:
            return plan
        listing = "; ".join(problems[:5]) + (
            f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        )
        latest = self.config.load_step == -1 and plan.step is not None
        if not (self.config.fallback_on_corruption and latest):
            raise CheckpointError(
                f"{plan.path} failed verification: {listing}. Run `dcpkit verify {plan.path}` "
                "for the full list; set [checkpoint] fallback_on_corruption = true to load the "
                "newest intact checkpoint instead, or load_step to choose one"
            )
        for step in reversed([s for s in self.published_steps() if s < plan.step]):
            path = self.step_path(step)
            if self.rank == 0:
                logger.warning(
                    "checkpoint: %s failed verification (%s); falling back to %s",
                    plan.path,
                    listing,
                    path,
                )
            if not self.verify(path):
                return LoadPlan(
                    str(path), step, step == 0, f"fallback: step-{plan.step} failed verification"
                )
            plan = LoadPlan(str(path), step, step == 0, "")
        raise CheckpointError(
            f"no published checkpoint in {self.folder} passes verification (the latest failed "
            f"with: {listing}); restore the files or start fresh in another folder"
        )

    def load_from(self, path: str | Path, model_only: bool = False) -> list[str]:
        """Load the checkpoint at ``path`` into the current state (any world size).

        Returns the names of the state pieces restored.
        """
        if is_url(path):
            names = set(Remote(str(path), self.config.storage_options).ls_names())
            if names & layout.HF_FILES and layout.METADATA not in names:
                self._load_hf(path)
                return [MODEL]
        else:
            path = Path(path)
            if layout.is_hf(path) and not (path / layout.METADATA).is_file():
                self._load_hf(path)
                return [MODEL]
        reader = self._reader(path)
        try:
            metadata = reader.read_metadata()
        except FileNotFoundError:
            raise CheckpointError(
                f"{path} is not a checkpoint: it has no {layout.METADATA}"
            ) from None
        saved = set(metadata.state_dict_metadata)

        def has_group(name: str) -> bool:
            prefix = name + "."
            return name in saved or any(k.startswith(prefix) for k in saved)

        template: dict[str, Any] = {}
        model_sd = self.model.state_dict()
        missing = sorted(k for k in model_sd if k not in saved)
        if missing:
            shown = ", ".join(missing[:8]) + (
                f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            )
            raise CheckpointError(
                f"{path} does not hold {len(missing)} of this model's parameters ({shown}); "
                "is it a checkpoint of another model or flavor?"
            )
        template.update(model_sd)
        restored = [MODEL]
        excluded = set(self.config.exclude_from_loading)
        pieces: list[str] = []
        if not model_only:
            for name in self.states:
                if name in excluded:
                    logger.info("checkpoint: not loading %r (exclude_from_loading)", name)
                elif not has_group(name):
                    logger.warning("checkpoint: %s holds no %r; it starts fresh", path, name)
                else:
                    template[name] = self.states[name].state_dict()
                    pieces.append(name)
        rng_plan = None
        if not model_only and self.save_rng and RNG not in excluded:
            rng_plan = self._plan_rng(saved, path)
            if rng_plan is not None:
                template[RNG] = {rng_key(rng_plan[0]): b""}
        with dist.quiet_single_process():
            dcp.load(template, storage_reader=self._reader(path), no_dist=not dist.is_dist())
        self.model.load_state_dict({k: template[k] for k in model_sd})
        for name in pieces:
            self.states[name].load_state_dict(template[name])
            restored.append(name)
        if rng_plan is not None:
            source, offset = rng_plan
            restore_rng(template[RNG][rng_key(source)], reseed_offset=offset)
            restored.append(RNG)
        return restored

    def _reader(self, path: str | Path) -> Any:
        if is_url(path):
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            return FsspecReader(str(path), **(self.config.storage_options or {}))
        return FileSystemReader(str(path))

    def _load_hf(self, path: str | Path) -> None:
        """Load model weights from a Hugging Face folder, one parameter at a time (on an object
        store, read in place by range requests)."""
        if is_url(path):
            from dcpkit.files import forget_origin
            from dcpkit.remote import copy_path, stream_copy

            tmp = stream_copy(str(path), self.config.storage_options)
            local = copy_path(tmp, str(path))
            try:
                self._load_hf_folder(local, str(path))
            finally:
                forget_origin(local)
                tmp.cleanup()
        else:
            self._load_hf_folder(Path(path), str(path))

    def _load_hf_folder(self, path: Path, name: str) -> None:
        """``path``: the folder to read; ``name``: how to call it in messages."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from dcpkit.convert.adapters import get_adapter
        from dcpkit.convert.safetensors_io import SafetensorsFolder

        if self.hf_model is None:
            raise CheckpointError(
                f"{name} is a Hugging Face folder; loading it needs hf_model=HFModel(...)"
            )
        adapter = get_adapter(self.hf_model.family)
        args = self.hf_model.args
        folder = SafetensorsFolder(path)
        try:
            plan = adapter.plan_from_hf(
                {k: folder.shape(k) for k in folder.names()},
                args,
                adapter.flavor_name(args) or "custom",
                name,
            )
            wanted = set(self.model.state_dict())
            options = StateDictOptions(full_state_dict=True, strict=False)
            for hf, canon, tf in plan.pairs:
                if canon not in wanted:
                    raise CheckpointError(f"{name}: {hf} maps to {canon}, which this model lacks")
                t = folder.read(hf)
                t = tf.from_hf(t) if tf is not None else t
                for part in self.model.parts:
                    set_model_state_dict(part, {canon: t}, options=options)
        finally:
            folder.close()

    def _plan_rng(self, saved: set[str], path: Path) -> tuple[int, int] | None:
        saved_ranks = sorted(int(k.split("_")[-1]) for k in saved if k.startswith(f"{RNG}.rank_"))
        if not saved_ranks:
            logger.warning("checkpoint: %s holds no RNG state; RNG streams start fresh", path)
            return None
        saved_world = len(saved_ranks)
        source, offset = rng_source_rank(self.rank, saved_world)
        if saved_world != self.world_size and self.rank == 0:
            logger.warning(
                "checkpoint: RNG saved by %d ranks, restored on %d: rank r takes saved rank "
                "r %% %d%s",
                saved_world,
                self.world_size,
                saved_world,
                "; ranks beyond the saved ones fork that stream (offset r // saved)"
                if self.world_size > saved_world
                else "",
            )
        return source, offset

    # ------------------------------------------------------------------ save

    def should_save(self, step: int, last_step: bool = False) -> bool:
        cfg = self.config
        if not cfg.enable or cfg.load_only or step == self.last_saved_step:
            return False
        if step == 1 and cfg.enable_first_step_checkpoint:
            return True
        return last_step or step % cfg.interval == 0

    def maybe_wait_for_staging(self) -> None:
        """Block until the state being staged for a save may be modified: call it before
        ``optimizer.step()``. Only an asynchronous save's memory copy is waited for."""
        if self._async is not None:
            self._async.wait_for_staging()

    def save(self, step: int, last_step: bool = False, force: bool = False) -> bool:
        """Save at ``step`` if the policy says so (or ``force``). Returns whether it saved."""
        if not (
            self.should_save(step, last_step)
            or (
                force
                and self.config.enable
                and not self.config.load_only
                and step != self.last_saved_step
            )
        ):
            return False
        model_only = last_step and self.config.last_save_model_only
        state = self.collect(model_only=model_only)
        start = time.perf_counter()
        if self._async is not None and not (last_step or force):
            self._async.save(state, self._step_info(step, model_only))
            self.last_saved_step = step
            logger.info(
                "checkpoint: step %d staging (%s), written in the background; %.3fs in save()",
                step,
                self.config.async_mode,
                time.perf_counter() - start,
            )
            return True
        if self._async is not None:
            # The last (or a forced) save is synchronous and durable: drain the writer first.
            self._async.wait()
        if model_only and self.config.last_save_in_hf:
            self._write_hf(state, step)
        else:
            self._write(state, step, model_only)
        self.last_saved_step = step
        logger.info(
            "checkpoint: saved step %d%s to %s in %.2fs (checksums %.3fs)",
            step,
            " (model only, " + self.config.export_dtype + ")" if model_only else "",
            self.step_path(step),
            time.perf_counter() - start,
            self.last_checksum_s,
        )
        return True

    def save_seed_checkpoint(self) -> Path:
        """Save the model alone as step 0 (``create_seed_checkpoint``)."""
        self._write(self.collect(model_only=True, cast=False), 0, model_only=True)
        self.last_saved_step = 0
        return Path(self.step_path(0))

    def collect(self, model_only: bool = False, cast: bool = True) -> dict[str, Any]:
        """The state dict to write, in TorchTitan's top-level layout."""
        state: dict[str, Any] = dict(self.model.state_dict())
        if model_only:
            dtype = _DTYPES[self.config.export_dtype]
            if cast and dtype != torch.float32:
                state = {
                    k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v
                    for k, v in state.items()
                }
            return state
        for name, obj in self.states.items():
            state[name] = obj.state_dict()
        if self.save_rng:
            state[RNG] = {rng_key(self.rank): capture_rng()}
        return state

    def _step_info(self, step: int, model_only: bool) -> StepInfo:
        return StepInfo(
            folder=Path(self.folder) if self.remote is None else Path("."),
            step=step,
            groups=[MODEL] if model_only else self.state_names(),
            keep_latest_k=self.config.keep_latest_k,
            dtype=self.config.export_dtype if model_only else None,
            mesh=self._mesh_info(),
            url=self.remote.url if self.remote is not None else None,
            storage_options=self.config.storage_options or None,
        )

    def _write(self, state: dict[str, Any], step: int, model_only: bool) -> None:
        self.last_checksum_s = write_and_publish(self._step_info(step, model_only), state)

    def _write_hf(self, state: dict[str, Any], step: int) -> None:
        """The last save as Hugging Face safetensors: a model-only DCP save into a temporary
        folder, converted (streaming) by rank 0, then published like any other step."""
        from dcpkit.convert.hf import to_hf

        assert self.hf_model is not None
        staging = layout.temp_dir(self.folder, step).with_name(f"{layout.TEMP_PREFIX}{step}-dcp")
        tmp = layout.temp_dir(self.folder, step)
        if self.rank == 0:
            layout.clean_leftovers(self.folder)
            staging.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with dist.quiet_single_process():
            dcp.save(state, storage_writer=StepWriter(staging, step), no_dist=not dist.is_dist())
        if self.rank == 0:
            to_hf(
                staging,
                tmp,
                self.hf_model.family,
                self.hf_model.args,
                tokenizer=self.hf_model.tokenizer,
                force=True,
            )
            files = data_files(tmp)
            manifest = build_manifest(
                step,
                self.world_size,
                [MODEL],
                describe_files(tmp, files),
                dtype=self.config.export_dtype,
                mesh=self._mesh_info(),
                source="hf",
            )
            write_manifest(tmp, manifest)
            layout.publish(tmp, layout.step_dir(self.folder, step))
            shutil.rmtree(staging, ignore_errors=True)
            layout.apply_retention(self.folder, self.config.keep_latest_k)
        dist.barrier()

    def _mesh_info(self) -> dict[str, Any] | None:
        from torch.distributed.tensor import DTensor

        for part in self.model.parts:
            for p in part.parameters():
                if isinstance(p, DTensor):
                    mesh = p.device_mesh
                    return {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or [])}
        return None

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Drain pending asynchronous saves (raising their errors) and stop the writer."""
        if self._async is not None:
            async_ckpt, self._async = self._async, None
            async_ckpt.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
