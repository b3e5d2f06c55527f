"""The weights a push sends, by the engine's (Hugging Face) names, one tensor at a time: a live
model's parameters (FSDP2 and TP shards gathered a tensor at a time, a collective every trainer
rank takes part in) or a checkpoint's model, through the families' key maps."""

from __future__ import annotations

from typing import Any

import torch

from dcpkit.convert.adapters import ConversionError, get_adapter
from dcpkit.convert.adapters.base import infer_family
from dcpkit.convert.views import ToHF


class LiveState:
    """A model's parameters by their trainer names, read as whole tensors: a ``DTensor`` is
    gathered (``full_tensor``, on every rank at once); the last one is kept for the experts of
    a stacked tensor, which are read one by one."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self._last: tuple[str, torch.Tensor] | None = None

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.params[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self.params[key].dtype

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        if self._last is None or self._last[0] != key:
            self._last = None  # the previous tensor freed before the next is gathered
            p = self.params[key].detach()
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            self._last = (key, full)
        full = self._last[1]
        return full if rows is None else full[rows[0] : rows[1]]

    def done(self) -> None:
        self._last = None


def stage(
    params: dict[str, torch.Tensor], kept: dict[str, torch.Tensor], mesh: Any
) -> dict[str, torch.Tensor]:
    """A copy of ``params`` in ``kept`` (memory kept from push to push), each rank copying only
    what it holds: a ``DTensor``'s local shard, as a ``DTensor`` again on ``mesh`` (the push's
    own group: gathered there while training goes on with the model's). A parameter under two
    names (a tied output) is copied once."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    seen: dict[int, torch.Tensor] = {}
    for name, p in params.items():
        if id(p) in seen:
            out[name] = seen[id(p)]
            continue
        t = p.detach()
        local = t.to_local() if isinstance(t, DTensor) else t
        copy = kept.get(name)
        if copy is None or copy.shape != local.shape or copy.dtype != local.dtype:
            copy = kept[name] = torch.empty(local.shape, dtype=local.dtype)
        copy.copy_(local)
        if isinstance(t, DTensor):
            if mesh is None or t.device_mesh.ndim != 1 or t.device_mesh.size() != mesh.size():
                raise ValueError(
                    f"{name}: an asynchronous push gathers a DTensor on a mesh of every rank "
                    f"in one dimension; this one's mesh is {tuple(t.device_mesh.shape)}: push "
                    "it with push() (synchronous)"
                )
            copy = DTensor.from_local(copy, mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())  # fmt: skip
        out[name] = seen[id(p)] = copy
    return out


class Identity:
    """Names kept as they are (a transformers model, or a family ``hf`` checkpoint)."""

    def __init__(self, src: Any, names: list[str]) -> None:
        self.src, self._names = src, names

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.src.shape(name))

    def dtype(self, name: str) -> torch.dtype:
        return self.src.dtype(name)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.src.read(name, rows)


def parameters(model: Any) -> dict[str, torch.Tensor]:
    """``model``'s parameters by name (a module, or a dict of tensors already): a tied output
    stays under both its names, as a save holds it."""
    if hasattr(model, "named_parameters"):
        return dict(model.named_parameters(remove_duplicate=False))
    return dict(model)


def model_view(model: Any, family: str | None, args: Any, where: str = "the model") -> Any:
    """``model``'s parameters (a module, or a dict of tensors) by the engine's names.
    ``family``: a dcpkit family (``llama3``, ``qwen3``, ``qwen3_moe``, ...) whose key map and
    ``args`` (the model's args; a dcpkit model's own ``.args`` when None) convert the names;
    ``hf`` or None on transformers' names: sent as they are."""
    params = parameters(model)
    live = LiveState(params)
    if family is None:
        family, _ = infer_family(None, list(params))
    if family == "hf":
        return Identity(live, list(params))
    args = args if args is not None else getattr(model, "args", None)
    if args is None:
        raise ConversionError(f"{where}: family {family} needs the model's args (args=...)")
    adapter = get_adapter(family)
    plan = adapter.plan_to_hf({k: live.shape(k) for k in params}, args, "custom", where)
    return ToHF(live, plan)
