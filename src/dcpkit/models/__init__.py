"""Reference models with TorchTitan's parameter names, in a registry keyed by family name."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dcpkit.models.llama3 import LLAMA3_FLAVORS, Llama3, Llama3Args, build_llama3
from dcpkit.models.qwen3 import QWEN3_FLAVORS, Qwen3, Qwen3Args, build_qwen3

_BUILDERS: dict[str, Callable[..., nn.Module]] = {"llama3": build_llama3, "qwen3": build_qwen3}
_FLAVORS: dict[str, dict[str, object]] = {"llama3": LLAMA3_FLAVORS, "qwen3": QWEN3_FLAVORS}


def known_models() -> list[str]:
    return sorted(_BUILDERS)


def flavors(name: str) -> dict[str, object]:
    """The named flavors of a model family."""
    _check_name(name)
    return dict(_FLAVORS[name])


def build_model(name: str, flavor: str, **overrides: object) -> nn.Module:
    """Build ``name`` at ``flavor``; works under ``with torch.device("meta"):`` too."""
    _check_name(name)
    return _BUILDERS[name](flavor, **overrides)


def _check_name(name: str) -> None:
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(known_models())}")


__all__ = ["Llama3", "Llama3Args", "Qwen3", "Qwen3Args", "build_model", "flavors", "known_models"]
