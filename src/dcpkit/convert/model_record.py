"""What a checkpoint records of its model: the family and a ``config.json`` (an import's own,
or one made from a trained model's args), in its manifest, bound by the manifest's seal. An
export reads it back: no flavor to pass, and the ``config.json`` the model came with, changed
only where the export must change it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError, ModelAdapter, get_adapter
from dcpkit.convert.adapters.base import infer_family
from dcpkit.convert.adapters.hf import HFConfig, layer_count, read_config_json
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


@dataclass
class ResolvedModel:
    """A checkpoint's model as an export or a push reads it: its family's adapter, the args
    and the flavor's name, the ``config.json`` it was given or recorded (an export gives it
    back, changed only where it must), and where family and args came from (a note to say)."""

    adapter: ModelAdapter
    args: Any
    flavor: str
    keys: list[str]
    original: dict[str, Any] | None = None
    inferred: str | None = None


def resolve_model(
    src: Any, recorded: dict[str, Any] | None, name: str, family: str | None, flavor: Any, verb: str
) -> ResolvedModel:
    """The model of the step ``src`` (``name`` in messages): family and args from what its
    manifest records (``recorded``: ``recorded_model`` of its folder) when neither is given
    otherwise, the family inferred from the parameters' names when none is given; ``flavor`` a
    flavor name, a ``config.json`` (its path, or a dict) or args. ``verb``: the command, in
    messages."""
    keys = [k for k in src.tensors if src.is_model_key(k)]
    inferred = None
    if recorded is not None and flavor is None and family in (None, recorded["family"]):
        family, flavor = recorded["family"], recorded["config"]
        inferred = f"model family {family} and its args: from the checkpoint's manifest"
    if family is None:
        family, why = infer_family(None, keys)
        inferred = f"model family {family}: {why} (--model to choose another)"
    no_config = not isinstance(flavor, str | Path) or not Path(flavor).exists()
    if family == "hf" and no_config and not isinstance(flavor, dict | HFConfig):
        raise ConversionError(
            f"{name}'s parameters carry transformers' names: {verb} needs --model hf "
            "--config CONFIG_JSON (the model's config.json)"
        )
    if flavor is None:
        raise ConversionError(
            f"{verb} needs --flavor (e.g. --flavor 8B) or --config CONFIG_JSON: {name} records "
            "no model, and head counts cannot be read from the tensors' shapes"
        )
    adapter = get_adapter(family)
    if isinstance(flavor, dict):  # a config.json, given or recorded
        args = bounded_args(adapter, flavor, len(keys), name)
        return ResolvedModel(adapter, args, adapter.flavor_name(args) or "custom (from the "
                             "recorded config.json)", keys, flavor, inferred)  # fmt: skip
    args, flavor = resolve_flavor(adapter, flavor)
    return ResolvedModel(adapter, args, flavor, keys, None, inferred)


def resolve_flavor(adapter: ModelAdapter, flavor: str | Any) -> tuple[Any, str]:
    """Model args from a flavor name, a ``config.json`` (its path, or its folder), or args."""
    if isinstance(flavor, str | Path) and adapter.family != "hf" and Path(flavor).exists():
        config = read_config_json(flavor)
        args = plausible_args(adapter, config, str(flavor), None)
        return args, adapter.flavor_name(args) or "custom (from config.json)"
    if isinstance(flavor, str):
        args = adapter.resolve_flavor(flavor)
        return args, (flavor if adapter.flavors else adapter.flavor_name(args) or flavor)
    return flavor, adapter.flavor_name(flavor) or "custom"


def plausible_args(adapter: ModelAdapter, config: Any, name: str, src: Any) -> Any:
    """Model args from ``config.json``, refused when they describe more than the folder holds
    (a hostile or wrong config would otherwise make the checks themselves run away)."""
    if not isinstance(config, dict):
        raise ConversionError(f"{name}/config.json is not a JSON object")
    try:
        args = adapter.args_from_hf_config(config)
    except (KeyError, TypeError, ValueError) as e:
        raise ConversionError(
            f"{name}/config.json cannot be read as {adapter.family}: {e}"
        ) from None
    if src is None:
        return args
    held = len(src.names())
    if not 0 < int(getattr(args, "n_layers", 1)) <= held:
        raise ConversionError(
            f"{name}/config.json describes {getattr(args, 'n_layers', '?')} layers, but the "
            f"folder holds {held} tensors: the config does not belong to these weights"
        )
    need = sum(math.prod(shape) for shape in adapter.expected_shapes(args).values())
    have = sum(src.nbytes(k) for k in src.names())
    if need > have:
        raise ConversionError(
            f"{name}/config.json describes {need:,} parameters, but the folder holds "
            f"{have:,} bytes of weights: the config does not belong to these weights"
        )
    return args
