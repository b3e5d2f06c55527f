"""The reference trainer: Llama 3 on CPU or GPU under torchrun, FSDP2 (+TP), dcpkit checkpoints.

torchrun --nproc-per-node 2 -m dcpkit.train --job.config_file configs/llama3_debugmodel.toml
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from dcpkit import dist
from dcpkit.config import ConfigError
from dcpkit.manager import CheckpointError, CheckpointManager
from dcpkit.models import build_model
from dcpkit.train.config import TrainConfig, load_config
from dcpkit.train.data import GlobalBatchLoader, TokenSamples, prepare_corpus
from dcpkit.train.lr import build_scheduler
from dcpkit.train.parallelize import build_mesh, device_for_rank, mesh_shape, parallelize

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
    if "RANK" in os.environ and not torch_dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch_dist.init_process_group(backend=backend)


def _setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("dcpkit")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


def _prepare_data(cfg: TrainConfig, vocab_size: int, rank: int):
    # Rank 0 trains the tokenizer and tokenizes once; the others read the cache it leaves.
    if rank == 0:
        corpus = prepare_corpus(vocab_size, cfg.training.dataset_path)
    dist.barrier()
    if rank != 0:
        corpus = prepare_corpus(vocab_size, cfg.training.dataset_path)
    return corpus


class MetricsWriter:
    """One JSON object per step in ``metrics.jsonl`` (rank 0), and a readable line."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.file = open(path, "a") if enabled else None  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        saved = "  [checkpoint saved]" if record["checkpoint_saved"] else ""
        logger.info(
            "step %4d | loss %.6f | lr %.2e | tokens %9d | %.2fs/step | ckpt stall %.3fs%s",
            record["step"],
            record["loss"],
            record["lr"],
            record["tokens_seen"],
            record["step_time_s"],
            record["checkpoint_stall_s"],
            saved,
        )

    def close(self) -> None:
        if self.file:
            self.file.close()


def train(cfg: TrainConfig) -> int:
    """Run training as configured; returns the last step reached."""
    _init_distributed()
    rank, world = dist.rank(), dist.world_size()
    _setup_logging(rank)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_for_rank(local_rank)
    dp, tp = mesh_shape(cfg.parallelism, world)
    dump = Path(cfg.job.dump_folder)
    if rank == 0:
        dump.mkdir(parents=True, exist_ok=True)
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True)
    ck = cfg.checkpoint
    if ck.create_seed_checkpoint:
        if world != 1:
            raise ConfigError(
                "[checkpoint] create_seed_checkpoint needs exactly one rank (the model is saved "
                f"unsharded), this run has {world}; run it with --nproc-per-node 1"
            )
        if not ck.enable:
            raise ConfigError(
                "[checkpoint] create_seed_checkpoint needs [checkpoint] enable = true"
            )

    torch.manual_seed(cfg.training.seed)
    model = build_model(cfg.model.name, cfg.model.flavor, max_seq_len=cfg.training.seq_len)
    vocab = model.args.vocab_size
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "dcpkit train: %s %s (%.2fM parameters) on %d rank(s): dp_shard=%d tp=%d, %s",
        cfg.model.name,
        cfg.model.flavor,
        n_params / 1e6,
        world,
        dp,
        tp,
        device.type,
    )
    if ck.create_seed_checkpoint:
        mgr = CheckpointManager(ck, dump, model)
        path = mgr.save_seed_checkpoint()
        logger.info("seed checkpoint written to %s", path)
        return 0

    corpus = _prepare_data(cfg, vocab, rank)
    if rank == 0:
        (dump / "tokenizer.json").write_text(corpus.tokenizer_json)
    mesh = build_mesh(device.type, dp, tp)
    model = parallelize(model.to(device), mesh)
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=opt.lr,
        betas=(opt.beta1, opt.beta2),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
    )
    scheduler = build_scheduler(optimizer, cfg.training.steps, cfg.lr_scheduler)
    samples = TokenSamples(corpus.tokens, cfg.training.seq_len)
    loader = GlobalBatchLoader(
        samples,
        cfg.training.global_batch_size,
        dp_rank=mesh["dp_shard"].get_local_rank(),
        dp_degree=dp,
        seed=cfg.training.seed,
    )
    state = TrainState()
    torch.manual_seed(cfg.training.seed + rank)
    mgr = CheckpointManager(
        ck,
        dump,
        model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        dataloader=loader,
        states={"train_state": state},
    )
    mgr.load()
    if state.step:
        logger.info("resuming after step %d (%d tokens seen)", state.step, state.ntokens_seen)
    dp_group = mesh["dp_shard"].get_group() if dist.is_dist() else None
    metrics = MetricsWriter(dump / "metrics.jsonl", rank == 0)
    tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
    try:
        while state.step < cfg.training.steps:
            step = state.step + 1
            t0 = time.perf_counter()
            inputs, labels = loader.next_batch()
            inputs, labels = inputs.to(device), labels.to(device)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            grad_norm = None
            if cfg.training.max_norm > 0:
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    model.parameters(), cfg.training.max_norm, foreach=True
                )
                if hasattr(grad_norm, "full_tensor"):
                    grad_norm = grad_norm.full_tensor()
            stall0 = time.perf_counter()
            mgr.maybe_wait_for_staging()
            stall = time.perf_counter() - stall0
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step = step
            state.ntokens_seen += tokens_per_step
            global_loss = loss.detach().clone()
            if dp_group is not None and dp > 1:
                torch_dist.all_reduce(global_loss, group=dp_group)
                global_loss /= dp
            stall0 = time.perf_counter()
            stop_here = step == cfg.training.stop_at_step
            saved = mgr.save(step, last_step=step == cfg.training.steps, force=stop_here)
            stall += time.perf_counter() - stall0
            metrics.write(
                {
                    "step": step,
                    "loss": global_loss.item(),
                    "lr": lr,
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "tokens_seen": state.ntokens_seen,
                    "world_size": world,
                    "checkpoint_stall_s": stall,
                    "checkpoint_saved": saved,
                    "step_time_s": time.perf_counter() - t0,
                }
            )
            if stop_here:
                logger.info("stopping after step %d (training.stop_at_step)", step)
                break
    finally:
        mgr.close()
        metrics.close()
    return state.step


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = load_config(argv)
        train(cfg)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        if dist.rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()
        return 2
    if torch_dist.is_initialized():
        torch_dist.barrier()
        torch_dist.destroy_process_group()
    return 0
