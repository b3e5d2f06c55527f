"""What a checkpoint records of its model: the family and a ``config.json`` (an import's own,
or one made from a trained model's args), in its manifest, bound by the manifest's seal. An
export reads it back: no flavor to pass, and the ``config.json`` the model came with, changed
only where the export must change it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError, ModelAdapter
from dcpkit.convert.adapters.hf import layer_count
from dcpkit.layout import dtype_name


def model_record(family: str, config: Any) -> dict[str, Any] | None:
    """What a checkpoint's manifest records of its model (see ``build_manifest``)."""
    return {"family": family, "config": config} if isinstance(config, dict) else None


def recorded_model(folder: Path) -> dict[str, Any] | None:
    """The model a checkpoint's manifest records, if it records one (and its seal holds)."""
    from dcpkit.manifest import MANIFEST, parse_manifest

    path = Path(folder) / MANIFEST
    if not path.is_file() or path.stat().st_size > 64 << 20:
        return None
    manifest, problems = parse_manifest(path.read_bytes())
    model = (manifest or {}).get("model")
    if problems or not isinstance(model, dict) or not isinstance(model.get("config"), dict):
        return None
    return model if isinstance(model.get("family"), str) else None


def kept_config(
    original: dict[str, Any], dtype: torch.dtype, bos: int | None, eos: int | None, notes: list
) -> dict[str, Any]:
    """``original`` with only what the export changes: the dtype, and the special tokens of a
    tokenizer given with it; each change said in ``notes``."""
    config, name = dict(original), dtype_name(dtype)
    changes = {k: name for k in ("torch_dtype", "dtype") if k in config}
    changes.update(
        {k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None}
    )
    for key, value in changes.items():
        if config.get(key) != value:
            notes.append(f"config.json: {key} {config.get(key)!r} -> {value!r} (the export's)")
            config[key] = value
    return config


def bounded_args(adapter: ModelAdapter, config: dict[str, Any], n_keys: int, name: str) -> Any:
    """Model args from a recorded ``config.json``, refused when it describes more layers than
    the checkpoint has tensors (the checks would otherwise run away on a hostile one)."""
    layers = layer_count(config)
    if not isinstance(layers, int) or not 0 < layers <= n_keys:
        raise ConversionError(
            f"{name}: the recorded config.json gives num_hidden_layers {layers!r} for a "
            f"checkpoint of {n_keys} tensors; pass --flavor or --config"
        )
    return adapter.args_from_hf_config(config)
