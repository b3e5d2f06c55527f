"""PEFT LoRA steps out as what PEFT and transformers read: the adapter folder
(``adapter_config.json`` + ``adapter_model.safetensors``, ``PeftModel.from_pretrained``'s), or,
merged, the base model with each adapter's product added to its weight (``from_pretrained``'s).

A step of a PEFT model holds the wrapped model's names (``base_model.model.<name>``, each adapted
layer's own weight under ``base_layer``, its adapters under ``lora_A.<adapter>`` and
``lora_B.<adapter>``); the manifest records the adapter's name and its ``LoraConfig``
(``peft_record``, written by the Trainer integration), without which an export cannot know the
scaling. Merging follows PEFT's own rule for LoRA: ``W + scaling * (B @ A)``, transposed where
the layer stores its weight transposed (``fan_in_fan_out``) and for embeddings, with scaling
``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``). Settings that change that rule per layer
or add to it (``rank_pattern``, ``alpha_pattern``, DoRA, adapter biases) and modules trained
whole beside the adapters (``modules_to_save``) are refused by name rather than merged wrong.
"""

from __future__ import annotations

import enum
import json
import math
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError
from dcpkit.convert.common import progress, row_blocks
from dcpkit.convert.result import ConversionResult
from dcpkit.formats.blocks import recycled_blocks
from dcpkit.formats.safetensors import SafetensorsWriter
from dcpkit.layout import ADAPTER_FILE

PREFIX = "base_model.model."
NOTE = "a PEFT model: from the checkpoint's manifest (the base's config.json and the LoRA config)"
ADAPTER_FILES = ("adapter_config.json", ADAPTER_FILE)


def peft_record(model: Any) -> dict[str, Any] | None:
    """What a step's manifest records of a PEFT model (None for any other model): the active
    adapter's name and its config, as ``adapter_config.json`` holds it."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    name = getattr(model, "active_adapter", None)
    name = name[0] if isinstance(name, list | tuple) and name else name
    name = name if name in configs else next(iter(configs))
    config = json.loads(json.dumps(configs[name].to_dict(), default=_plain))
    return {"adapter": name, "config": config}


def _plain(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    return str(value)


def lora_settings(record: Any, name: str) -> tuple[str, dict[str, Any]]:
    """The adapter's name and its LoRA config from a manifest's record, refused (naming the
    setting) where an export could not be exact."""
    adapter = record.get("adapter") if isinstance(record, dict) else None
    config = record.get("config") if isinstance(record, dict) else None
    if not isinstance(adapter, str) or not isinstance(config, dict):
        raise ConversionError(f"{name}: its manifest's PEFT record is not one: {record!r:.200}")
    if config.get("peft_type") != "LORA":
        raise ConversionError(
            f"{name}: a PEFT {config.get('peft_type')} adapter; dcpkit exports LoRA adapters only"
        )
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise ConversionError(f"{name}: its LoRA config gives r={r!r}, lora_alpha={alpha!r}")
    return adapter, config


def to_peft_folder(
    src: Any,
    pending: Any,
    name: str,
    recorded: dict[str, Any],
    merge: bool,
    tokenizer: str | Path | None,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
    budget: int,
) -> ConversionResult:
    """Write a PEFT step's export into the pending output ``pending`` (not yet published): the
    adapter folder, or with ``merge`` the merged model with the base's ``config.json``; the
    tokenizer files beside either, when given."""
    from dcpkit.convert.adapters import get_adapter
    from dcpkit.convert.hf_files import copy_tokenizer, find_tokenizer, special_ids, write_json
    from dcpkit.convert.model_record import bounded_args, kept_config

    tmp, peft = pending.scratch(), recorded["peft"]
    result = ConversionResult(str(tmp), notes=[NOTE])
    keys = [k for k in src.tensors if src.is_model_key(k)]
    args = bounded_args(get_adapter("hf"), recorded["config"], len(keys), name)
    tok = find_tokenizer(Path(tokenizer), None) if tokenizer else None
    bos, eos = special_ids(tok, args)
    if merge:
        merged = export_merged(
            src, tmp, peft, name, dtype, max_shard_bytes, budget, pending.digests
        )
        result.tensors, result.bytes, out_dtype = merged
        config_dtype = dtype or max(out_dtype.values(), key=list(out_dtype.values()).count)
        config = kept_config(recorded["config"], config_dtype, bos, eos, result.notes)
        write_json(tmp / "config.json", config)
        bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
        generation = {"_from_model_config": True, "bos_token_id": bos, "eos_token_id": eos}
        write_json(tmp / "generation_config.json", generation)
    else:
        result.tensors, result.bytes = export_adapter(src, tmp, peft, name)
        result.notes.append(f"the adapter {peft['adapter']!r}; --merge writes the merged model")
    if tok is not None:
        copy_tokenizer(tok, tmp, args, bos, eos, result)
    return result


def export_adapter(src: Any, dest: Path, record: Any, name: str) -> tuple[int, int]:
    """Write the adapter folder PEFT reads into the empty folder ``dest``; (tensors, bytes)."""
    from safetensors.torch import save_file

    adapter, config = lora_settings(record, name)
    keys = _adapter_keys(src, adapter, name)
    tensors = {k.replace(f".{adapter}", "", 1): src.read(k).contiguous() for k in keys}
    save_file(tensors, str(dest / ADAPTER_FILES[1]), metadata={"format": "pt"})
    (dest / ADAPTER_FILES[0]).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors.values())


def _adapter_keys(src: Any, adapter: str, name: str) -> list[str]:
    keys = [k for k in src.tensors if src.is_model_key(k)]
    whole = [k for k in keys if ".modules_to_save." in k]
    if whole:
        raise ConversionError(
            f"{name}: modules trained whole beside the adapters (modules_to_save: {whole[0]}"
            f"{' ...' if len(whole) > 1 else ''}) are not exported by dcpkit yet"
        )
    lora = [k for k in keys if f".{adapter}." in f"{k}." and ".lora_" in k]
    if not lora:
        raise ConversionError(f"{name}: no LoRA weights of adapter {adapter!r} in the step")
    return lora


def export_merged(
    src: Any,
    dest: Path,
    record: Any,
    name: str,
    dtype: torch.dtype | None,
    max_shard_bytes: int,
    budget: int,
    digests: dict | None = None,
) -> tuple[int, int, dict[str, torch.dtype]]:
    """Write the base model with every adapter merged into its weight as safetensors shards
    into ``dest`` (the caller writes ``config.json``); (tensors, bytes, dtype by name). Each
    merged weight is read and written in row blocks of at most ``budget`` bytes."""
    adapter, config = lora_settings(record, name)
    for setting in ("rank_pattern", "alpha_pattern"):
        if config.get(setting):
            raise ConversionError(f"{name}: {setting} {config[setting]} is not merged by dcpkit")
    for setting in ("use_dora", "lora_bias"):
        if config.get(setting):
            raise ConversionError(
                f"{name}: {setting} is on: such adapters are not merged by dcpkit"
            )
    r, alpha = config["r"], config["lora_alpha"]
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    lora = set(_adapter_keys(src, adapter, name))
    merged = _merged_names(src, lora, adapter, name)
    out_dtype = {hf: dtype or src.dtype(key) for hf, (key, _) in merged.items()}
    entries = [(hf, src.shape(key), out_dtype[hf]) for hf, (key, _) in merged.items()]
    writer = SafetensorsWriter(dest, entries, max_shard_bytes, {"source": "dcpkit"}, digests)
    transposed = bool(config.get("fan_in_fan_out"))
    with progress(writer.total_size, "to-hf --merge") as bar, recycled_blocks():
        for hf, (key, pair) in merged.items():
            a = b = None
            if pair is not None:  # the adapter's two factors: r rows or columns each, small
                a, b = (src.read(k).to(torch.float64) for k in pair)
            for rows in row_blocks(src.shape(key), src.dtype(key).itemsize, budget):
                t = src.read(key, rows)
                if a is not None and b is not None:
                    t = t + _delta(a, b, rows, scaling, transposed or ".lora_embedding_" in pair[0])
                t = t.to(out_dtype[hf])
                writer.write(hf, t, rows)
                bar.update(t.numel() * t.element_size())
                del t
    writer.close()
    return len(merged), writer.total_size, out_dtype


def _delta(a: torch.Tensor, b: torch.Tensor, rows: Any, scaling: float, transposed: bool) -> Any:
    """Rows ``rows`` of the adapter's product ``scaling * (B @ A)`` (transposed: of its
    transpose, ``A.T @ B.T``), in float64 and rounded once, to the weight's rows."""
    lo, hi = rows if rows is not None else (0, (a.shape[1] if transposed else b.shape[0]))
    product = a[:, lo:hi].T @ b.T if transposed else b[lo:hi] @ a
    return (product * scaling).to(torch.float32)


def _merged_names(
    src: Any, lora: set[str], adapter: str, name: str
) -> dict[str, tuple[str, tuple[str, str] | None]]:
    """``{transformers name: (the step's key of its weight, its (A, B) keys or None)}`` for
    every model tensor but the adapters' own."""
    found: dict[str, tuple[str, tuple[str, str] | None]] = {}
    for key in src.tensors:
        if not src.is_model_key(key) or key in lora:
            continue
        if not key.startswith(PREFIX):
            raise ConversionError(f"{name}: {key} is no parameter of a PEFT model's base")
        hf = key[len(PREFIX) :]
        pair = None
        if ".base_layer." in hf:
            layer, leaf = hf.split(".base_layer.", 1)
            hf = f"{layer}.{leaf}"
            if leaf == "weight":
                pair = _factors(f"{PREFIX}{layer}", adapter, lora, name)
        found[hf] = (key, pair)
    return found


def _factors(layer: str, adapter: str, lora: set[str], name: str) -> tuple[str, str] | None:
    for a, b in (
        (f"{layer}.lora_A.{adapter}.weight", f"{layer}.lora_B.{adapter}.weight"),
        (f"{layer}.lora_embedding_A.{adapter}", f"{layer}.lora_embedding_B.{adapter}"),
    ):
        if a in lora and b in lora:
            return a, b
        if a in lora or b in lora:
            raise ConversionError(f"{name}: {layer} has one of its LoRA factors, not both")
    return None
