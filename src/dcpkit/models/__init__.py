"""Reference models with TorchTitan's parameter names, in a registry keyed by family name."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dcpkit.models.deepseek_v3 import (
    DEEPSEEK_V3_FLAVORS,
    DeepSeekV3,
    DeepSeekV3Args,
    build_deepseek_v3,
)
from dcpkit.models.llama3 import LLAMA3_FLAVORS, Llama3, Llama3Args, build_llama3
from dcpkit.models.moe import MoEArgs
from dcpkit.models.qwen3 import QWEN3_FLAVORS, Qwen3, Qwen3Args, build_qwen3
from dcpkit.models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3Moe, Qwen3MoeArgs, build_qwen3_moe

_BUILDERS: dict[str, Callable[..., nn.Module]] = {
    "llama3": build_llama3,
    "qwen3": build_qwen3,
    "qwen3_moe": build_qwen3_moe,
    "deepseek_v3": build_deepseek_v3,
}
_FLAVORS: dict[str, dict[str, object]] = {
    "llama3": LLAMA3_FLAVORS,
    "qwen3": QWEN3_FLAVORS,
    "qwen3_moe": QWEN3_MOE_FLAVORS,
    "deepseek_v3": DEEPSEEK_V3_FLAVORS,
}


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


__all__ = [
    "DeepSeekV3",
    "DeepSeekV3Args",
    "Llama3",
    "Llama3Args",
    "MoEArgs",
    "Qwen3",
    "Qwen3Args",
    "Qwen3Moe",
    "Qwen3MoeArgs",
    "build_model",
    "flavors",
    "known_models",
]
