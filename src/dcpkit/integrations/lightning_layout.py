"""How Lightning's checkpoint dict is laid out in a dcpkit checkpoint, and read back whole.

The LightningModule's parameters at the top level (without ``model_prefix``); everything else
Lightning keeps under ``lightning``, the optimizers' states under ``optimizer``; integer keys
saved as ``int:N`` (DCP names values by their path of keys, as text)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dcpkit.engine.reading import dcp_reader, load_failure
from dcpkit.errors import CheckpointError, CorruptCheckpoint
from dcpkit.layout import OPTIMIZER
from dcpkit.safe_pickle import safe_load_planner

LIGHTNING = "lightning"
"""The top-level group holding everything of Lightning's checkpoint besides the parameters."""


def to_layout(checkpoint: dict[str, Any], prefix: str, location: str) -> dict[str, Any]:
    params = checkpoint.get("state_dict", {})
    outside = [k for k in params if not k.startswith(prefix)]
    if outside:
        raise CheckpointError(
            f"{location}: parameters {', '.join(outside[:4])} do not start with model_prefix "
            f"{prefix!r}: they would not be found again"
        )
    state: dict[str, Any] = {k.removeprefix(prefix): v for k, v in params.items()}
    clash = [k for k in state if k.split(".")[0] in (LIGHTNING, OPTIMIZER)]
    if clash:
        raise CheckpointError(f"{location}: parameter {clash[0]!r} takes a reserved name")
    if "optimizer_states" in checkpoint:  # not a weights-only checkpoint
        optimizers = list(checkpoint["optimizer_states"])
        state[OPTIMIZER] = _encode_keys(optimizers, location, OPTIMIZER)
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    state[LIGHTNING] = _encode_keys(rest, location, LIGHTNING)
    return state


_INT_KEY = "int:"


def _encode_keys(obj: Any, location: str, where: str) -> Any:
    """DCP names every saved value by its path of dict keys, as text: an optimizer's state,
    keyed by parameter index (0, 1, ...), would come back keyed "0", "1", ... and torch's
    ``load_state_dict`` would keep it beside fresh state instead of restoring it. Integer keys
    are saved as ``int:N`` and read back as N; other keys must be text."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if type(key) is int:
                name = f"{_INT_KEY}{key}"
            elif type(key) is str and not key.startswith(_INT_KEY):
                name = key
            else:
                raise CheckpointError(
                    f"{location}: {where} has the key {key!r}: keys must be text (not starting "
                    f"with {_INT_KEY!r}) or integers"
                )
            out[name] = _encode_keys(value, location, f"{where}.{key}")
        return out
    if isinstance(obj, list | tuple):
        items = [_encode_keys(v, location, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def decode_keys(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {
            (int(k[len(_INT_KEY) :]) if k.startswith(_INT_KEY) else k): decode_keys(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [decode_keys(v) for v in obj]
    return obj


def from_layout(state: dict[str, Any], prefix: str, location: str) -> dict[str, Any]:
    if LIGHTNING not in state:
        raise CheckpointError(f"{location} is not a Lightning checkpoint written by dcpkit")
    checkpoint = decode_keys(state.pop(LIGHTNING))
    if OPTIMIZER in state:
        checkpoint["optimizer_states"] = decode_keys(state.pop(OPTIMIZER))
    checkpoint["state_dict"] = {prefix + k: v for k, v in state.items()}
    return checkpoint


def read_whole(store: Any, name: str, location: str, only: str | None = None) -> dict[str, Any]:
    """Checkpoint ``name`` read whole (or its group ``only``) into a new dict (a dict of dicts,
    as saved), its tensors bound first by the bytes its data files really hold."""
    reader, _ = dcp_reader(store, name)
    metadata = reader.read_metadata()
    stored = sum(store.size(f"{name}/{n}") for n in store.list_names(name) if n.endswith(".distcp"))
    sizes = {
        fqn: md.properties.dtype.itemsize * math.prod(int(d) for d in md.size)
        for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    negative = next(
        (
            fqn
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) and any(int(d) < 0 for d in md.size)
        ),
        None,
    )
    if negative is not None:
        shape = list(metadata.state_dict_metadata[negative].size)
        raise CorruptCheckpoint(f"{location}/.metadata: {negative}: negative size {shape}")
    wanted = sum(sizes.values())
    if wanted > stored:
        largest = max(sizes, key=sizes.__getitem__)
        raise CorruptCheckpoint(
            f"{location}/.metadata: {largest}: its tensors claim {wanted} bytes ({largest} "
            f"{sizes[largest]}) but its data files hold {stored}: damaged or not a checkpoint"
        )
    planner = safe_load_planner(everything=True, keys=None if only is None else {only})
    dcp_load({}, reader, planner, location)
    return planner.original_state_dict  # dcp.load fills a dict of its own, the planner's


def dcp_load(template: dict[str, Any], reader: Any, planner: Any, location: str) -> None:
    """``dcp.load``, its failure one error naming the checkpoint (never DCP's traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from dcpkit.safe_pickle import UnsafeCheckpoint

    try:
        dcp.load(template, storage_reader=reader, planner=planner, no_dist=True)
    except (CheckpointException, UnsafeCheckpoint) as e:
        raise load_failure(e, location) from None


def move(obj: Any, where: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(where)
    if isinstance(obj, dict):
        return {k: move(v, where) for k, v in obj.items()}
    if isinstance(obj, list):
        return [move(v, where) for v in obj]
    return obj
