"""Saving: collect the state (DTensors stay sharded), then write it synchronously, hand it to the
asynchronous checkpointer, or export it as a Hugging Face folder, all published through the
same pending-step path. Old steps are deleted by a background thread, never before the new step
is published, so that a synchronous save returns as soon as its step is durable."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.tensor import DTensor

from dcpkit import dist
from dcpkit.config import ConfigError
from dcpkit.engine import planning
from dcpkit.engine.async_save import AsyncCheckpointer
from dcpkit.engine.plan_seed import Seed
from dcpkit.engine.policy import config_problem, replacing_problem, steps_to_delete
from dcpkit.engine.publish import (
    Published,
    StepInfo,
    delete_steps,
    retrying_alone,
    save_failure,
    transient,
    write_and_publish,
)
from dcpkit.engine.restore import HFCodec
from dcpkit.engine.states import ModelState, Stateful, capture_rng, rank_key
from dcpkit.errors import CheckpointError
from dcpkit.layout import DTYPES, MODEL, RNG, staging_name, step_name
from dcpkit.manifest import build_manifest

logger = logging.getLogger(__name__)


def collect(
    model: ModelState,
    states: dict[str, Stateful],
    *,
    rng: bool,
    model_only: bool = False,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The state dict to write, in TorchTitan's top-level layout; a model-only save has its
    floating tensors cast to ``dtype``."""
    with torch.no_grad():  # detached tensors, without autograd's bookkeeping
        state: dict[str, Any] = dict(model.state_dict())
        if not model_only:
            for name, obj in states.items():
                state[name] = obj.state_dict()
    if model_only:
        target = DTYPES[dtype]
        if target != torch.float32:
            state = {
                k: v.to(target) if torch.is_tensor(v) and v.is_floating_point() else v
                for k, v in state.items()
            }
        return state
    if rng:
        state[RNG] = {rank_key(dist.rank()): capture_rng()}
    return state


def frozen_entries(
    model: ModelState, state: dict[str, Any], link: bool = True
) -> dict[str, str] | None:
    """The entries of ``state`` that are frozen parameters of ``model`` (``requires_grad``
    False: a LoRA run's base), each with a token of its shape, dtype and content, which changes
    whenever the tensor does: a version counter would not (a write through ``.data``, as an EMA
    update may make, leaves it as it was). None when there are none (or not ``link``:
    ``[checkpoint] link_frozen = false``)."""
    if not link:
        return None
    frozen: set[int] = set()
    for part in model.parts:
        for p in part.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if not p.requires_grad and local.numel():
                frozen.add(local.data_ptr())
    if not frozen:
        return None
    out = {}
    with torch.no_grad():
        for key, value in state.items():
            local = value.to_local() if isinstance(value, DTensor) else value
            if torch.is_tensor(local) and local.numel() and local.data_ptr() in frozen:
                out[key] = f"{tuple(local.shape)}:{local.dtype}:{_content(local)}"
    return out or None


def _content(t: torch.Tensor) -> str:
    """A fingerprint of ``t``'s bytes: xxh3-64 of its memory on the CPU; on a device, three sums
    over its 32-bit words (plain, squared, position-weighted) computed there, in chunks."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.device.type == "cpu":
        return xxhash.xxh3_64_hexdigest(flat.numpy())
    words = flat.view(torch.int32) if flat.numel() % 4 == 0 else flat.to(torch.int32)
    sums = torch.zeros(3, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), 1 << 24):
        chunk = words[start : start + (1 << 24)].to(torch.int64)
        where = torch.arange(start, start + chunk.numel(), device=flat.device)
        sums += torch.stack([chunk.sum(), (chunk * chunk).sum(), (chunk * where).sum()])
    return ":".join(str(int(x)) for x in sums.tolist())


def mesh_info(model: ModelState) -> dict[str, Any] | None:
    for part in model.parts:
        for p in part.parameters():
            if isinstance(p, DTensor):
                mesh = p.device_mesh
                return {"shape": list(mesh.shape), "dim_names": list(mesh.mesh_dim_names or [])}
    return None


def write_hf_step(info: StepInfo, state: dict[str, Any], hf: HFCodec) -> Published:
    """The last save as a Hugging Face folder: a model-only DCP save into a staging entry,
    converted (streaming) by rank 0 into the pending step, then published like any other."""
    store = info.store
    staging = store.begin(staging_name(info.step), info.step)
    pending = store.begin(step_name(info.step), info.step)
    if dist.rank() == 0:
        staging.prepare()
    dist.barrier()
    with dist.quiet_single_process():
        dcp.save(state, storage_writer=staging.dcp_writer(), no_dist=not dist.is_dist())
    doomed: list[int] = []
    if dist.rank() == 0:
        pending.prepare()
        try:
            with staging.view() as view:
                hf.export(view, pending.scratch())
        finally:
            staging.abort()
        manifest = build_manifest(
            info.step,
            dist.world_size(),
            [MODEL],
            pending.describe(pending.local_files()),
            dtype=info.dtype,
            mesh=info.mesh,
            source="hf",
        )
        pending.write_manifest(manifest)
        pending.publish()
        doomed = steps_to_delete(store.published_steps(), info.keep_latest_k, info.best)
    dist.barrier()
    return Published(0.0, doomed)


def check_config(config: Any, state_names: list[str], hf: Any, model: ModelState) -> None:
    """Every rank, before training: the options fit the state, and what the last save needs
    is there (a Hugging Face last save: the family can export this model, the tokenizer
    exists), so that a run never trains to its end to fail at its final save."""
    error = config_problem(config, state_names, hf is not None)
    if not error and config.enable and config.last_save_in_hf and not config.load_only:
        shapes: dict[str, tuple[int, ...]] = {}  # global shapes; pipeline stages' merged
        for part in dist.all_gather_object(
            {k: tuple(v.shape) for k, v in model.state_dict().items()}
        ):
            shapes.update(part)
        check = getattr(hf, "check", None)
        failed = dist.first_rank_error(lambda: check and check(shapes), (ValueError,))
        error = f"[checkpoint] last_save_in_hf = true, but {failed}" if failed else None
    if error:
        raise ConfigError(error)


def check_replacement(info: StepInfo, resumed_from: int | None) -> None:
    """Every rank: refuse to replace a published step that is not this run's to replace, and
    log each replacement that is (rank 0 lists the folder and decides). A folder that cannot be
    listed within ``info.retry_s`` (``[checkpoint] storage_retry_s``) fails the save on every
    rank, as a write that fails does: it could hold a step that is not this run's to replace."""
    store, step = info.store, info.step
    decision, published = None, []
    if dist.rank() == 0:
        try:
            published = retrying_alone(store.published_steps, info.retry_s)
        except Exception as e:
            tried = f"; retried for {info.retry_s:.0f}s ([checkpoint] storage_retry_s): giving up"
            decision = save_failure(e, info, {}) + (tried if transient(e) else "")
    if step in published:
        decision = replacing_problem(step, published, resumed_from) or ""
        if decision:
            decision = f"{store.location(step_name(step))}: {decision}"
        else:
            logger.warning(
                "checkpoint: replacing the published %s in %s (this run resumed from step %s; "
                "the steps after it are replaced as it reaches them)",
                step_name(step),
                store.root,
                resumed_from,
            )
    decision = dist.broadcast_object(decision)
    if decision:
        raise CheckpointError(decision)


class Saver:
    """Dispatches saves: synchronous, asynchronous (staging + background writer), or as a
    Hugging Face folder; deletes old steps in the background."""

    def __init__(self, async_mode: str) -> None:
        self._deleter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcpkit-retention")
        self.plan_key = planning.new_key()  # one plan cache for this saver's durable saves
        self.async_ckpt: AsyncCheckpointer | None = None
        if async_mode != "disabled":
            self.async_ckpt = AsyncCheckpointer(async_mode, self._retire, self.plan_key)
        self.last_checksum_s = 0.0
        self._seed: Seed | None = None
        self._seed_index: Any = None  # a downloaded index lives as long as this reference

    def resumed(self, read: dict[str, Any], step: int) -> None:
        """After a full load of this folder's ``step`` (``read``: what the load read by): the
        next durable save takes its plans from that checkpoint when the layout is the same."""
        index, world = read.get("index"), read.get("world")
        self._seed_index = index
        ok = index is not None and isinstance(world, int)
        self._seed = Seed(str(index.path), world, step) if ok else None

    def _take_seed(self) -> Seed | None:
        seed, self._seed = self._seed, None
        return seed

    def save_async(self, state: dict[str, Any], info: StepInfo) -> None:
        assert self.async_ckpt is not None
        if self._seed is None and self._seed_index is not None:  # its save written: free it
            self.async_ckpt.wait()
            self._seed_index = None
        self.async_ckpt.save(state, info, self._take_seed())

    def save_sync(self, state: dict[str, Any], info: StepInfo, hf: HFCodec | None = None) -> None:
        """Write and publish now (draining an asynchronous save first)."""
        self.wait()
        if hf is not None:
            published = write_hf_step(info, state, hf)
        else:
            planner = planning.CachingPlanner(self.plan_key, self._take_seed())
            published = write_and_publish(info, state, planner=planner, delete_now=False)
            self._seed_index = None if self._seed is None else self._seed_index
        self.last_checksum_s = published.checksum_s
        if published.doomed:
            self._retire(info.store, published.doomed)

    def _retire(self, store: Any, steps: list[int]) -> None:
        """Delete ``steps`` in the background (after any deletion already queued)."""
        self._deleter.submit(_delete_logging_failures, store, steps)

    def wait_for_staging(self) -> None:
        if self.async_ckpt is not None:
            self.async_ckpt.wait_for_staging()

    def wait(self) -> None:
        """Block until the last save is durable (raising its error)."""
        if self.async_ckpt is not None:
            self.async_ckpt.wait()

    def global_plans(self) -> int:
        """DCP global plannings this rank ran as coordinator (in its writer process, if any)."""
        if self.async_ckpt is not None and self.async_ckpt.use_process:
            return self.async_ckpt.global_plans()
        return planning.global_plans(self.plan_key)

    def wait_for_deletions(self) -> None:
        self._deleter.submit(lambda: None).result()

    def close(self) -> None:
        try:
            if self.async_ckpt is not None:
                async_ckpt, self.async_ckpt = self.async_ckpt, None
                async_ckpt.close()
        finally:
            self._deleter.shutdown(wait=True)
            planning.forget(self.plan_key)
            self._seed = self._seed_index = None


def _delete_logging_failures(store: Any, steps: list[int]) -> None:
    try:
        delete_steps(store, steps)
    except Exception as e:  # a retention failure must not end training; say so
        logger.warning(
            "checkpoint: retention could not delete step %s from %s: %s",
            ", ".join(map(str, steps)),
            store.root,
            e,
        )
