"""``CheckpointConfig``: TorchTitan's ``[checkpoint]`` options, validated, plus the small
dataclass <-> TOML machinery that the trainer's other sections share."""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcpkit.layout import DTYPES

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
EXPORT_DTYPES = tuple(DTYPES)


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the option and how to fix it."""


@dataclass
class CheckpointConfig:
    """TorchTitan's ``[checkpoint]`` options, same names, defaults and meanings."""

    enable: bool = False
    """Turn checkpointing on."""
    folder: str = "checkpoint"
    """Checkpoint folder, joined to the base (dump) folder unless absolute."""
    interval: int = 500
    """Save every ``interval`` steps (and at the last step)."""
    initial_load_path: str | None = None
    """Checkpoint to start from when ``folder`` holds no checkpoint yet."""
    initial_load_model_only: bool = True
    """The initial load restores the model only."""
    initial_load_in_hf: bool = False
    """The initial load reads Hugging Face safetensors (needs ``initial_load_model_only``)."""
    last_save_model_only: bool = True
    """The save at the last step holds the model only."""
    last_save_in_hf: bool = False
    """The last save is written as Hugging Face safetensors (needs ``last_save_model_only``)."""
    export_dtype: str = "float32"
    """dtype of floating tensors in a model-only last save: float16, bfloat16 or float32."""
    async_mode: str = "disabled"
    """disabled, async or async_with_pinned_mem (case-insensitive)."""
    keep_latest_k: int = 10
    """Published checkpoints kept; 0 keeps all; 1 is refused (the newest may be in flight)."""
    link_frozen: bool = True
    """Frozen parameters (``requires_grad`` False: a LoRA run's base model) are written once per
    run: a later save whose frozen parameters did not change links their files from the save
    before it (a hard link; on S3, a copy the store makes) instead of writing them again."""
    load_step: int = -1
    """Step to load; -1 loads the latest published step."""
    exclude_from_loading: list[str] = field(default_factory=list)
    """State keys not restored on load (``model`` cannot be excluded)."""
    enable_first_step_checkpoint: bool = False
    """Also save after step 1."""
    create_seed_checkpoint: bool = False
    """Build the model on one rank without parallelism, save it as step 0 and stop."""
    load_only: bool = False
    """Load checkpoints but never save."""
    load_model_only: bool = False
    """Restore only the model from the checkpoint folder's step (optimizer, scheduler, data and
    RNG start fresh): how to go on from a model-only save, such as a finished run's last one."""
    verify_on_load: bool = True
    """Check the checkpoint's file sizes and checksums before loading it (ranks split the work)."""
    fallback_on_corruption: bool = False
    """When the latest checkpoint fails verification, load the newest one that passes."""
    lease_timeout_s: float = 60.0
    """A run holds a lease on its folder, renewed every quarter of this; another run takes it
    over when its holder is gone (a dead pid on this host, or this long without a heartbeat)."""
    storage_retry_s: float = 120.0
    """How long a save or a load retries transient storage errors (no answer, a reset
    connection, throttling), with backoff, before it fails naming the endpoint and the step."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Options for fsspec when ``folder`` is a URL (e.g. ``{endpoint_url = "...", key = ...}``)."""
    local_interval: int = 0
    """Memory tier: every this many steps each rank writes its shard of the full state to
    ``local_folder`` (node-local shared memory) in the background; 0 turns it off."""
    local_folder: str = ""
    """Memory-tier folder; empty: ``/dev/shm/dcpkit-<hash of the checkpoint folder>``."""
    local_keep: int = 2
    """Memory-tier steps kept per rank (and per replica)."""
    local_replicas: int = 0
    """1: each rank also holds a copy of a partner rank's memory-tier shard, on another node."""
    emergency_save: bool = False
    """On SIGTERM (preemption), every rank finishes its step, saves it durably and exits with
    code 75; ranks agree on the step each step through one small all-reduce."""
    emergency_timeout_s: float = 60.0
    """Grace period after SIGTERM: past it (or at a second SIGTERM) the process exits at once."""

    def __post_init__(self) -> None:
        check_fields(self, "checkpoint")
        self.async_mode = self.async_mode.lower()
        if not str(self.folder).strip():
            raise ConfigError("[checkpoint] folder must not be empty (default: 'checkpoint')")
        if not self.storage_retry_s >= 0:
            raise ConfigError(
                f"[checkpoint] storage_retry_s must be >= 0, got {self.storage_retry_s}"
            )
        if self.local_interval < 0:
            raise ConfigError(
                f"[checkpoint] local_interval must be >= 0, got {self.local_interval}"
            )
        if self.local_keep < 1:
            raise ConfigError(f"[checkpoint] local_keep must be >= 1, got {self.local_keep}")
        if self.local_replicas not in (0, 1):
            raise ConfigError(
                f"[checkpoint] local_replicas must be 0 or 1, got {self.local_replicas}"
            )
        if not self.emergency_timeout_s > 0:
            raise ConfigError(
                f"[checkpoint] emergency_timeout_s must be > 0, got {self.emergency_timeout_s}"
            )
        if not self.lease_timeout_s > 0:
            raise ConfigError(
                f"[checkpoint] lease_timeout_s must be > 0, got {self.lease_timeout_s}"
            )
        if self.interval < 1:
            raise ConfigError(
                f"[checkpoint] interval must be >= 1, got {self.interval}: it is the number of "
                "steps between two saves"
            )
        if self.keep_latest_k == 1 or self.keep_latest_k < 0:
            raise ConfigError(
                f"[checkpoint] keep_latest_k = {self.keep_latest_k} is not allowed: use 0 to keep "
                "every checkpoint or a value >= 2 (the newest checkpoint may still be being "
                "written while the previous one is the only complete one)"
            )
        if self.load_step < -1:
            raise ConfigError(
                f"[checkpoint] load_step must be -1 (latest) or a step >= 0, got {self.load_step}"
            )
        if self.async_mode not in ASYNC_MODES:
            raise ConfigError(
                f"[checkpoint] async_mode {self.async_mode!r} is not one of "
                f"{', '.join(ASYNC_MODES)}"
            )
        if self.export_dtype not in EXPORT_DTYPES:
            raise ConfigError(
                f"[checkpoint] export_dtype {self.export_dtype!r} is not one of "
                f"{', '.join(EXPORT_DTYPES)}"
            )
        if "model" in self.exclude_from_loading:
            raise ConfigError(
                "[checkpoint] exclude_from_loading may not contain 'model': a checkpoint is "
                "loaded to restore the model"
            )
        if self.initial_load_in_hf and not self.initial_load_path:
            raise ConfigError(
                "[checkpoint] initial_load_in_hf = true, but initial_load_path is not set: set it "
                "to the Hugging Face folder to start from (or set initial_load_in_hf = false)"
            )
        if self.initial_load_in_hf and not self.initial_load_model_only:
            raise ConfigError(
                "[checkpoint] initial_load_in_hf = true requires initial_load_model_only = true: "
                "Hugging Face folders hold model weights only"
            )
        if self.last_save_in_hf and not self.last_save_model_only:
            raise ConfigError(
                "[checkpoint] last_save_in_hf = true requires last_save_model_only = true: "
                "Hugging Face folders hold model weights only"
            )

    @classmethod
    def from_toml(cls, path: str | Path) -> CheckpointConfig:
        """Read the ``[checkpoint]`` section of a TOML file (other tables, such as a trainer's
        ``[job]``, are left alone). A file without that table, or with options outside any
        table, is refused naming the file: its options would be silently ignored."""
        content = read_toml(path)
        loose = sorted(k for k, v in content.items() if not isinstance(v, dict))
        if loose:
            raise ConfigError(
                f"{path}: {', '.join(loose)} lie outside any table; put checkpoint options "
                "under a [checkpoint] table"
            )
        if not isinstance(content.get("checkpoint"), dict):
            raise ConfigError(
                f"{path} has no [checkpoint] table; its checkpoint options go under "
                "[checkpoint] (for example: [checkpoint] enable = true)"
            )
        return section_from_dict(cls, "checkpoint", content["checkpoint"])


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's content; a syntax error is a ``ConfigError`` naming the file and line."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror}") from None


# --- dataclass <-> dict machinery ---------------------------------------------------------------


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(the non-None type of ``annotation``, whether None is allowed)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (args[0] if len(args) == 1 else annotation), True
    return annotation, False


def coerce_value(
    section: str, name: str, annotation: Any, value: Any, from_text: bool = False
) -> Any:
    """Check a value against the option's type, naming the option when it is wrong. A value
    from TOML or Python must have the type (an int where a float is asked is taken); only a
    command-line string (``from_text``) is parsed: ``true``/``false``, numbers, JSON tables
    and lists (or a comma-separated list)."""
    base, optional = _base_type(annotation)
    where = f"[{section}] {name}"
    text = from_text and isinstance(value, str)
    if value is None or (optional and text and value.lower() in ("none", "")):
        if optional:
            return None
        raise ConfigError(f"{where} cannot be empty")
    origin = typing.get_origin(base)
    if base is bool:
        if isinstance(value, bool):
            return value
        if text and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if base in (int, float):
        kind = "an integer" if base is int else "a number"
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be {kind}, got {value!r}")
        if isinstance(value, int) or (base is float and isinstance(value, float)):
            return base(value)
        if text:
            try:
                return base(value)
            except ValueError:
                pass
        raise ConfigError(f"{where} must be {kind}, got {value!r}")
    if base is str:
        if isinstance(value, os.PathLike):
            return os.fspath(value)
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    if origin is dict or base is dict:
        if text:
            value = _json(where, value, "a table (JSON on the command line)")
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table, got {value!r}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(base) or (str,)
        if text and value.strip().startswith("["):
            value = _json(where, value, "a list (JSON or TOML syntax on the command line)")
        elif text:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [coerce_value(section, name, item_type, v) for v in value]
    return value


def _json(where: str, value: str, what: str) -> Any:
    """A command-line value in JSON, or in TOML's syntax (``['a', 'b']``, ``{k = 1}``)."""
    import json

    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"{where} must be {what}, got {value!r}") from None


def check_fields(obj: Any, section: str) -> None:
    """Every field of the dataclass ``obj`` has its declared type, whoever built it (Python,
    TOML, the command line): a wrong one is a ``ConfigError`` naming the option."""
    hints = _field_types(type(obj))
    for f in dataclasses.fields(obj):
        setattr(obj, f.name, coerce_value(section, f.name, hints[f.name], getattr(obj, f.name)))


def section_from_dict(
    cls: type, section: str, data: dict[str, Any], text: set[str] | frozenset[str] = frozenset()
) -> Any:
    """Build the dataclass of one TOML section; an unknown option is an error naming it.
    ``text``: the options whose value is a command-line string, parsed to the option's type."""
    if not isinstance(data, dict):
        raise ConfigError(f"[{section}] must be a table of options, got {data!r}")
    hints = _field_types(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown option {', '.join(f'[{section}] {u}' for u in unknown)}; "
            f"[{section}] knows: {', '.join(names)}"
        )
    kwargs = {k: coerce_value(section, k, hints[k], v, k in text) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"[{section}] {e}") from None


def section_to_dict(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
