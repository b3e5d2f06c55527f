"""The reference trainer: Llama 3 on CPU or GPU under torchrun, FSDP2 (+TP), dcpkit checkpoints.

torchrun --nproc-per-node 2 -m dcpkit.train --job.config_file configs/llama3_debugmodel.toml
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from dcpkit import CheckpointError, CheckpointManager, ConfigError, HFModel, dist
from dcpkit.engine.async_save import AsyncSaveError
from dcpkit.engine.preempt import EXIT_PREEMPTED
from dcpkit.layout import step_name
from dcpkit.models import build_model, flavors
from dcpkit.models.moe import update_expert_bias
from dcpkit.train.config import TrainConfig, load_config
from dcpkit.train.data import GlobalBatchLoader, TokenSamples, prepare_corpus
from dcpkit.train.expert_parallel import build_ep_mesh, check_moe_layout
from dcpkit.train.grad import clip_grad_norm_
from dcpkit.train.lr import build_scheduler
from dcpkit.train.metrics import MetricsLogger
from dcpkit.train.parallelize import build_mesh, device_for_rank, mesh_layout, parallelize
from dcpkit.train.pipeline import Pipeline

logger = logging.getLogger("dcpkit.train")


@dataclass
class TrainState:
    """TorchTitan's ``train_state``: the step reached and the tokens seen."""

    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.ntokens_seen = int(state["ntokens_seen"])


def _init_distributed() -> None:
    if torch_dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ:
        torch_dist.init_process_group(backend=backend)
    else:
        # Started without torchrun: a one-process group, so meshes and DCP work the same way.
        torch_dist.init_process_group(
            backend=backend, store=torch_dist.HashStore(), rank=0, world_size=1
        )


def _setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("dcpkit")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    # The grad-norm reduction over a 2-D (dp, tp) mesh takes two all-reduces; DTensor warns about
    # that on every rank at the first step. Every rank still computes the same norm.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _prepare_data(cfg: TrainConfig, vocab_size: int, rank: int):
    # Rank 0 trains the tokenizer and tokenizes once; the others read the cache it leaves.
    if rank == 0:
        corpus = prepare_corpus(vocab_size, cfg.training.dataset_path, cfg.model.tokenizer_path)
    dist.barrier()
    if rank != 0:
        corpus = prepare_corpus(vocab_size, cfg.training.dataset_path, cfg.model.tokenizer_path)
    return corpus


class Trainer:
    """Sets up model, data, optimizer and checkpointing from a ``TrainConfig``; ``fit()`` trains."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        _init_distributed()
        self.rank, self.world = dist.rank(), dist.world_size()
        _setup_logging(self.rank)
        self.device = device_for_rank(int(os.environ.get("LOCAL_RANK", "0")))
        self.layout = mesh_layout(cfg.parallelism, self.world)
        self.dp, self.tp = self.layout.dp, self.layout.tp
        self.dump = Path(cfg.job.dump_folder)
        if self.dump.exists() and not self.dump.is_dir():  # every rank: they stop together
            raise ConfigError(
                f"[job] dump_folder {self.dump} is a file, not a folder: the run's folder holds "
                "its metrics and its checkpoint folder (made when missing); give a folder, or "
                "move the file away"
            )
        if self.rank == 0:
            self.dump.mkdir(parents=True, exist_ok=True)
        if cfg.training.deterministic:
            if self.device.type == "cuda":
                # cuBLAS is deterministic only with a fixed workspace; set before its first use.
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        ck = cfg.checkpoint
        if ck.create_seed_checkpoint and self.world != 1:
            raise ConfigError(
                "[checkpoint] create_seed_checkpoint needs exactly one rank (the model is saved "
                f"unsharded), this run has {self.world}; run it with --nproc-per-node 1"
            )
        if ck.create_seed_checkpoint and not ck.enable:
            raise ConfigError(
                "[checkpoint] create_seed_checkpoint needs [checkpoint] enable = true"
            )
        # Every rank builds the same full model from the seed, then keeps its shards: the
        # initial weights do not depend on the world size.
        torch.manual_seed(cfg.training.seed)
        model = build_model(cfg.model.name, cfg.model.flavor, max_seq_len=cfg.training.seq_len)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info(
            "dcpkit train: %s %s (%.2fM parameters) on %d rank(s): %s, %s",
            cfg.model.name,
            cfg.model.flavor,
            n_params / 1e6,
            self.world,
            self.layout.describe(),
            self.device.type,
        )
        check_moe_layout(
            model, self.layout.tp, self.layout.pp, self.layout.dp_replicate, self.layout.ep
        )
        self.model = model
        hf_model = HFModel(
            cfg.model.name,
            flavors(cfg.model.name)[cfg.model.flavor],
            tokenizer=cfg.model.tokenizer_path or str(self.dump / "tokenizer.json"),
        )
        if ck.create_seed_checkpoint:
            self.checkpoint = CheckpointManager(ck, self.dump, model, hf_model=hf_model)
            return
        corpus = _prepare_data(cfg, model.args.vocab_size, self.rank)
        if self.rank == 0:
            (self.dump / "tokenizer.json").write_text(corpus.tokenizer_json)
        layout = self.layout
        self.pipeline = None
        if layout.pp > 1 or layout.dp_replicate > 1:
            self.mesh = build_mesh(self.device.type, layout)
            dp_rank = (
                self.mesh["dp_replicate"].get_local_rank() * layout.dp_shard
                + self.mesh["dp_shard"].get_local_rank()
            )
            self.dp_groups = [
                self.mesh[d].get_group()
                for d in ("dp_replicate", "dp_shard")
                if self.mesh[d].size() > 1
            ]
        else:  # the plain FSDP (x TP) mesh, as it always was
            self.mesh = build_mesh(self.device.type, layout.dp_shard, layout.tp)
            dp_rank = self.mesh["dp_shard"].get_local_rank()
            self.dp_groups = [self.mesh["dp_shard"].get_group()] if layout.dp_shard > 1 else []
        if cfg.training.global_batch_size % self.dp:
            raise ConfigError(
                f"[training] global_batch_size ({cfg.training.global_batch_size}) must be "
                f"divisible by the data-parallel degree ({self.dp})"
            )
        if layout.pp > 1:
            self.pipeline = Pipeline(
                model,
                self.mesh,
                cfg.parallelism,
                self.device,
                cfg.training.global_batch_size // self.dp,
            )
            logger.info(self.pipeline.rule)
            parts = self.pipeline.parts
        else:
            ep_mesh = None
            if layout.ep > 1:
                ep_mesh = build_ep_mesh(self.device.type, layout.dp_shard, layout.ep)
            parts = [parallelize(model.to(self.device), self.mesh, ep_mesh=ep_mesh)]
        self.parts = parts
        self.model = parts[0]
        opt = cfg.optimizer
        self.optimizers = [
            torch.optim.AdamW(
                part.parameters(),
                lr=opt.lr,
                betas=(opt.beta1, opt.beta2),
                eps=opt.eps,
                weight_decay=opt.weight_decay,
            )
            for part in parts
        ]
        self.schedulers = [
            build_scheduler(o, cfg.training.steps, cfg.lr_scheduler) for o in self.optimizers
        ]
        self.optimizer, self.scheduler = self.optimizers[0], self.schedulers[0]
        self.loader = GlobalBatchLoader(
            TokenSamples(corpus.tokens, cfg.training.seq_len),
            cfg.training.global_batch_size,
            dp_rank=dp_rank,
            dp_degree=self.dp,
            seed=cfg.training.seed,
        )
        self.state = TrainState()
        # Every generator a checkpoint holds starts from the seed, so that two identical runs
        # write identical checkpoints (RNG included).
        torch.manual_seed(cfg.training.seed + self.rank)
        random.seed(cfg.training.seed + self.rank)
        np.random.seed(cfg.training.seed + self.rank)
        one = len(parts) == 1  # one model part: passed as itself, as a user would
        self.checkpoint = CheckpointManager(
            ck,
            self.dump,
            self.model if one else parts,
            optimizer=self.optimizer if one else self.optimizers,
            lr_scheduler=self.scheduler if one else self.schedulers,
            dataloader=self.loader,
            states={"train_state": self.state},
            hf_model=hf_model,
        )

    def fit(self) -> int:
        """Load the latest checkpoint, train to ``training.steps`` (or ``stop_at_step``, or a
        preemption with ``emergency_save``)."""
        cfg = self.cfg
        self.preempted = False
        if cfg.checkpoint.create_seed_checkpoint:
            path = self.checkpoint.save_seed_checkpoint()
            self.checkpoint.close()
            logger.info("seed checkpoint written to %s", path)
            return 0
        model, state = self.model, self.state
        loaded = self.checkpoint.load()
        if state.step:
            logger.info("resuming after step %d (%d tokens seen)", state.step, state.ntokens_seen)
        metrics = MetricsLogger(cfg, self.dump, self.rank == 0)
        saved_world = self._saved_world_size(loaded)
        if saved_world is not None and saved_world != self.world:
            logger.info(
                "resharding %d -> %d ranks (%s): model and optimizer by parameter name through "
                "DCP, whatever the saved layout; the dataloader's position is global",
                saved_world,
                self.world,
                self.layout.describe(),
            )
        metrics.start(
            self.world,
            resumed_from=state.step if loaded is not None else None,
            layout={
                "pp": self.layout.pp,
                "dp_replicate": self.layout.dp_replicate,
                "dp_shard": self.layout.dp_shard,
                "tp": self.layout.tp,
                "ep": self.layout.ep,
            },
            saved_world_size=saved_world,
        )
        async_mode = cfg.checkpoint.async_mode
        if async_mode == "disabled":
            async_mode = "sync"
        tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
        try:
            while state.step < cfg.training.steps:
                step = state.step + 1
                t0 = time.perf_counter()
                inputs, labels = self.loader.next_batch()
                inputs, labels = inputs.to(self.device), labels.to(self.device)
                if self.pipeline is not None:
                    global_loss = self.pipeline.step(inputs, labels)
                else:
                    logits = model(inputs)
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
                    loss.backward()
                    global_loss = loss.detach().clone()
                grad_norm = None
                if cfg.training.max_norm > 0:
                    grad_norm = clip_grad_norm_(
                        [p for part in self.parts for p in part.parameters()],
                        cfg.training.max_norm,
                        pp_group=self.pipeline.pp_group if self.pipeline else None,
                    )
                stall0 = time.perf_counter()
                self.checkpoint.maybe_wait_for_staging()
                stall = time.perf_counter() - stall0
                lr = self.scheduler.get_last_lr()[0]
                for part in self.parts:
                    update_expert_bias(part, self.dp_groups)
                for optimizer, scheduler in zip(self.optimizers, self.schedulers):
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                state.step = step
                state.ntokens_seen += tokens_per_step
                for group in self.dp_groups:
                    torch_dist.all_reduce(global_loss, group=group)
                if self.dp_groups:
                    global_loss /= self.dp
                stop_here = step == cfg.training.stop_at_step
                stall0 = time.perf_counter()
                saved = self.checkpoint.save(
                    step, last_step=step == cfg.training.steps, force=stop_here
                )
                save_s = time.perf_counter() - stall0
                stall += save_s
                in_memory = not saved and self.checkpoint.last_memory_step == step
                if saved or in_memory:
                    last = step == cfg.training.steps
                    metrics.event(
                        {
                            "event": "save",
                            "step": step,
                            "tier": "durable" if saved else "memory",
                            "mode": "memory"
                            if in_memory
                            else "sync"
                            if last or stop_here
                            else async_mode,
                            "model_only": last and cfg.checkpoint.last_save_model_only,
                            "save_call_s": save_s,
                            "stall_s": stall,
                        }
                    )
                step_time = time.perf_counter() - t0
                metrics.step(
                    {
                        "step": step,
                        "loss": global_loss.item(),
                        "lr": lr,
                        "grad_norm": grad_norm,
                        "tokens_seen": state.ntokens_seen,
                        "world_size": self.world,
                        "checkpoint_stall_s": stall,
                        "checkpoint_saved": saved,
                        "memory_tier_saved": in_memory,
                        "step_time_s": step_time,
                        "tokens_per_s": tokens_per_step / step_time,
                    },
                    last=step == cfg.training.steps or stop_here,
                )
                if self.checkpoint.preempted():
                    if not saved:
                        self.checkpoint.save(step, force=True)
                    metrics.event({"event": "preempted", "step": step})
                    logger.info(
                        "preempted (SIGTERM): step %d saved, exiting with code %d",
                        step,
                        EXIT_PREEMPTED,
                    )
                    self.preempted = True
                    break
                if stop_here:
                    logger.info("stopping after step %d (training.stop_at_step)", step)
                    break
        finally:
            self.checkpoint.close()
            metrics.close()
        return state.step

    def _saved_world_size(self, step: int | None) -> int | None:
        """The world size that wrote the checkpoint of ``step`` (rank 0 only; None if unknown)."""
        if step is None or self.rank != 0:
            return None
        try:
            manifest, _ = self.checkpoint.store.read_manifest(step_name(step))
        except Exception:  # only shown in the metrics; the load itself has already succeeded
            return None
        return (manifest or {}).get("world_size")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(argv)
        trainer = Trainer(cfg)
        trainer.fit()
    except (ConfigError, CheckpointError, AsyncSaveError, FileNotFoundError) as e:
        # Every rank that fails says why: the first rank to exit makes torchrun stop the others,
        # rank 0 too, perhaps before it had printed the error.
        rank = dist.rank()
        print(f"error: {e}" if rank == 0 else f"[rank {rank}] error: {e}", file=sys.stderr)
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        return 2
    if torch_dist.is_initialized():
        torch_dist.barrier()
        dist.settle()  # the model, which refers to the group, is freed after it is destroyed
        torch_dist.destroy_process_group()
    return EXIT_PREEMPTED if getattr(trainer, "preempted", False) else 0
