"""The reference trainer's configuration: TorchTitan's TOML sections and dotted overrides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcpkit.config import (
    CheckpointConfig,
    ConfigError,
    read_toml,
    section_from_dict,
    section_to_dict,
)
from dcpkit.train import CONFIGS


@dataclass
class Job:
    dump_folder: str = "./outputs"
    """Folder for checkpoints, metrics.jsonl and tokenizer.json."""
    description: str = ""
    """Free text shown at start."""


@dataclass
class Model:
    name: str = "llama3"
    """Model family."""
    flavor: str = "debugmodel"
    """Named size within the family."""
    tokenizer_path: str = ""
    """A tokenizer.json, a folder of Hugging Face tokenizer files, or a tokenizer.model (Llama 3's
    tiktoken file or SentencePiece); empty trains a byte-level BPE on the corpus."""


@dataclass
class Training:
    steps: int = 20
    """Length of the run (and of the lr schedule)."""
    global_batch_size: int = 8
    """Samples per step over all data-parallel ranks."""
    seq_len: int = 128
    """Tokens per sample."""
    seed: int = 0
    """Seed of the model initialisation, the data order and the RNG streams."""
    deterministic: bool = False
    """Use deterministic algorithms only."""
    max_norm: float = 1.0
    """Gradient clipping norm; 0 disables clipping."""
    dataset_path: str | None = None
    """A text file or a folder of text files; empty trains on the Python standard library."""
    stop_at_step: int = 0
    """Stop after this step with a full checkpoint, as a preemption would; 0 runs to ``steps``."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ConfigError(f"[training] steps must be >= 1, got {self.steps}")
        if self.global_batch_size < 1:
            raise ConfigError(
                f"[training] global_batch_size must be >= 1, got {self.global_batch_size}"
            )
        if self.seq_len < 1:
            raise ConfigError(f"[training] seq_len must be >= 1, got {self.seq_len}")
        if self.stop_at_step < 0:
            raise ConfigError(f"[training] stop_at_step must be >= 0, got {self.stop_at_step}")
        if self.max_norm < 0:
            raise ConfigError(f"[training] max_norm must be >= 0, got {self.max_norm}")


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Only AdamW."""
    lr: float = 8e-4
    """Peak learning rate."""
    eps: float = 1e-8
    """AdamW epsilon."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""

    def __post_init__(self) -> None:
        if self.name.lower() != "adamw":
            raise ConfigError(f"[optimizer] name {self.name!r} is not supported; use 'AdamW'")


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    """Linear warmup steps."""
    decay_ratio: float | None = None
    """Fraction of the steps after warmup spent decaying; None decays over all of them."""
    decay_type: str = "linear"
    """linear, sqrt or cosine."""
    min_lr_factor: float = 0.0
    """Floor of the decay, as a fraction of the peak lr."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"[lr_scheduler] warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_type not in ("linear", "sqrt", "cosine"):
            raise ConfigError(
                f"[lr_scheduler] decay_type {self.decay_type!r} is not linear, sqrt or cosine"
            )
        if self.decay_ratio is not None and not 0.0 <= self.decay_ratio <= 1.0:
            raise ConfigError(
                f"[lr_scheduler] decay_ratio must be in [0, 1], got {self.decay_ratio}"
            )


PIPELINE_SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "LoopedBFS": 2}
"""Pipeline schedules (TorchTitan's names) -> default stages per rank."""


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = 1
    """Replicas of the FSDP shards (HSDP when > 1): each replica holds a full copy, sharded."""
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 uses every rank that the other degrees leave."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel degree."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages over this many ranks (torch.distributed.pipelining)."""
    pipeline_parallel_schedule: str = "1F1B"
    """GPipe, 1F1B (one stage per rank), Interleaved1F1B or LoopedBFS (several per rank)."""
    pipeline_parallel_microbatch_size: int = 1
    """Samples per microbatch; the local batch is split into local_batch / this microbatches."""
    pipeline_parallel_layers_per_stage: int = 0
    """Transformer layers per stage; 0: the schedule's stages per rank (1, or 2 if interleaved)
    over the pipeline ranks, layers spread evenly."""
    expert_parallel_degree: int = 1
    """Ranks over which each MoE layer's experts are sharded, taken from the FSDP ranks (must
    divide data_parallel_shard_degree and the number of experts)."""

    def __post_init__(self) -> None:
        for name in (
            "data_parallel_replicate_degree",
            "tensor_parallel_degree",
            "pipeline_parallel_degree",
            "pipeline_parallel_microbatch_size",
            "expert_parallel_degree",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"[parallelism] {name} must be >= 1, got {getattr(self, name)}")
        if self.data_parallel_shard_degree < 1 and self.data_parallel_shard_degree != -1:
            raise ConfigError(
                "[parallelism] data_parallel_shard_degree must be >= 1 or -1, got "
                f"{self.data_parallel_shard_degree}"
            )
        if self.pipeline_parallel_schedule not in PIPELINE_SCHEDULES:
            raise ConfigError(
                f"[parallelism] pipeline_parallel_schedule {self.pipeline_parallel_schedule!r} "
                f"is not one of {', '.join(PIPELINE_SCHEDULES)}"
            )
        if self.pipeline_parallel_layers_per_stage < 0:
            raise ConfigError("[parallelism] pipeline_parallel_layers_per_stage must be >= 0")


@dataclass
class Metrics:
    log_freq: int = 10
    """Print a step's line, and send it to TensorBoard / W&B, every this many steps (and at the
    first step, at checkpoints and at the last step); metrics.jsonl gets every step."""
    enable_tensorboard: bool = False
    """Write TensorBoard scalars: loss, lr, grad norm, tokens/s, checkpoint stall."""
    save_tb_folder: str = "tb"
    """TensorBoard folder under the dump folder; a resumed run appends to it."""
    enable_wandb: bool = False
    """Log to Weights & Biases (needs the wandb package; offline unless WANDB_MODE says so)."""

    def __post_init__(self) -> None:
        if self.log_freq < 1:
            raise ConfigError(f"[metrics] log_freq must be >= 1, got {self.log_freq}")
        if not self.save_tb_folder or Path(self.save_tb_folder).is_absolute():
            raise ConfigError(
                f"[metrics] save_tb_folder must be a folder name under the dump folder, got "
                f"{self.save_tb_folder!r}"
            )


@dataclass
class TrainConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: Metrics = field(default_factory=Metrics)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: section_to_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}  # type: ignore[misc]


def _parse_overrides(argv: list[str]) -> tuple[str | None, dict[str, dict[str, str | None]]]:
    config_file = None
    overrides: dict[str, dict[str, str | None]] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(
                f"unexpected argument {arg!r}: options are written --section.option VALUE "
                "(for example --training.steps 20)"
            )
        name, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is None or (nxt.startswith("--") and "." in nxt):
                value = None  # a bare boolean flag
            else:
                value = nxt
                i += 1
        i += 1
        section, _, option = name.partition(".")
        if (section, option) == ("job", "config_file"):
            if value is None:
                raise ConfigError("--job.config_file needs a path")
            config_file = value
            continue
        overrides.setdefault(section, {})[option] = value
    return config_file, overrides


def load_config(argv: list[str]) -> TrainConfig:
    """TOML file (``--job.config_file``) first, then ``--section.option VALUE`` overrides."""
    config_file, overrides = _parse_overrides(argv)
    data: dict[str, dict[str, Any]] = {}
    if config_file:
        path = Path(config_file)
        if not path.is_file() and (shipped := CONFIGS / config_file).is_file():
            path = shipped  # a config shipped with the package, by name
        if not path.is_file():
            known = ", ".join(sorted(p.name for p in CONFIGS.glob("*.toml")))
            raise ConfigError(
                f"--job.config_file {config_file!r} does not exist (configs shipped with dcpkit, "
                f"usable by name: {known})"
            )
        data = read_toml(path)
    for section in list(data) + list(overrides):
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; known sections: {', '.join(SECTIONS)}")
    built = {}
    for section, cls in SECTIONS.items():
        values = dict(data.get(section, {}))
        hints = {f.name: f.type for f in dataclasses.fields(cls)}
        for option, raw in overrides.get(section, {}).items():
            if option not in hints:
                raise ConfigError(
                    f"unknown option [{section}] {option}; [{section}] knows: {', '.join(hints)}"
                )
            if raw is None:
                raw = "true"
            values[option] = raw
        text = set(overrides.get(section, {}))  # command-line strings, parsed to their types
        built[section] = section_from_dict(cls, section, values, text)
    return TrainConfig(**built)
