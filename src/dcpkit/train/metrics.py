"""What a run records: ``metrics.jsonl`` (every step, and the run's events), a readable line every
``log_freq`` steps, TensorBoard scalars and, when enabled, Weights & Biases (offline by default).

``metrics.jsonl`` holds one JSON object per line. A step's record has ``step`` and ``loss``;
an event has ``event``:

- ``{"event": "start", "world_size": W, "resumed_from": N | null, "saved_world_size": W0 | null,
  "config": {...}, ...}`` when a run (or a resume) starts (``W0``: the world size that wrote the
  checkpoint it resumed from);
- ``{"event": "save", "step": N, "mode": "sync" | "async" | "async_with_pinned_mem", ...}`` for
  every checkpoint, with the training time it blocked (``stall_s``).

A resumed run appends to the same file; the steps after its checkpoint are written again, and a
reader keeps the last record of each step (:func:`read_run`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from dcpkit.config import ConfigError
from dcpkit.runlog import METRICS_FILE, Run, read_run

__all__ = ["METRICS_FILE", "MetricsLogger", "Run", "read_run"]

logger = logging.getLogger("dcpkit.train")


TB_SCALARS = {
    "loss": "loss/global_avg",
    "lr": "lr",
    "grad_norm": "grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "checkpoint_stall_s": "checkpoint/stall_s",
}
"""Step-record field -> TensorBoard tag."""


class MetricsLogger:
    """Rank 0 writes; every other rank's logger does nothing."""

    def __init__(self, cfg: Any, dump: Path, enabled: bool) -> None:
        self.cfg = cfg.metrics
        self.enabled = enabled
        self.file = open(dump / METRICS_FILE, "a") if enabled else None  # noqa: SIM115
        self.tb = None
        self.wandb = None
        self.dump = dump
        self._full = cfg

    def start(
        self,
        world_size: int,
        resumed_from: int | None,
        layout: dict[str, int],
        saved_world_size: int | None = None,
    ) -> None:
        """Record the start (or resume) of a run, and open TensorBoard and W&B on rank 0."""
        if not self.enabled:
            return
        self.event(
            {
                "event": "start",
                "time": time.time(),
                "world_size": world_size,
                "resumed_from": resumed_from,
                "saved_world_size": saved_world_size,
                "layout": layout,
                "config": self._full.to_dict(),
            }
        )
        first_step = (resumed_from or 0) + 1
        if self.cfg.enable_tensorboard:
            self.tb = _tensorboard_writer(self.dump / self.cfg.save_tb_folder, first_step)
        if self.cfg.enable_wandb:
            self.wandb = _wandb_run(self.dump, self._full)

    def event(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def step(self, record: dict[str, Any], last: bool = False) -> None:
        """One step's record: always in metrics.jsonl; printed, and sent to TensorBoard and W&B,
        at the first step, every ``log_freq`` steps, at checkpoints and at the last step."""
        if not self.enabled:
            return
        self.event(record)
        step = record["step"]
        saves = record["checkpoint_saved"] or record.get("memory_tier_saved")
        if not (step == 1 or step % self.cfg.log_freq == 0 or saves or last):
            return
        saved = "  [checkpoint saved]" if record["checkpoint_saved"] else ""
        saved += "  [memory tier]" if record.get("memory_tier_saved") else ""
        logger.info(
            "step %4d | loss %.6f | lr %.2e | tokens %9d | %.2fs/step | ckpt stall %.3fs%s",
            step,
            record["loss"],
            record["lr"],
            record["tokens_seen"],
            record["step_time_s"],
            record["checkpoint_stall_s"],
            saved,
        )
        scalars = {
            tag: record[key] for key, tag in TB_SCALARS.items() if record.get(key) is not None
        }
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _tensorboard_writer(folder: Path, first_step: int) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            "[metrics] enable_tensorboard needs the tensorboard package: "
            "pip install 'dcpkit[tensorboard]'"
        ) from None
    # One TensorBoard run per dump folder: a resume appends to it, and purge_step makes
    # TensorBoard drop what the interrupted run logged after the checkpoint it resumed from.
    return SummaryWriter(log_dir=str(folder), purge_step=first_step if first_step > 1 else None)


def _wandb_run(dump: Path, cfg: Any) -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            "[metrics] enable_wandb needs the wandb package: pip install wandb"
        ) from None
    import os

    # Offline unless the environment says otherwise; steps a resume repeats are W&B's to drop.
    os.environ.setdefault("WANDB_MODE", "offline")
    run_id_file = dump / "wandb_run_id"
    run_id = run_id_file.read_text().strip() if run_id_file.is_file() else uuid.uuid4().hex[:8]
    run_id_file.write_text(run_id)
    return wandb.init(
        project=os.environ.get("WANDB_PROJECT", "dcpkit"),
        dir=str(dump),
        config=cfg.to_dict(),
        id=run_id,
        resume="allow",
    )
