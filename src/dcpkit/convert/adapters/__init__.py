"""Model-family adapters, in a registry keyed by family name."""

from __future__ import annotations

from dcpkit.convert.adapters.base import (
    ConversionError,
    ExpertOf,
    KeyPlan,
    ModelAdapter,
    RopePermute,
)
from dcpkit.convert.adapters.deepseek_v3 import DeepSeekV3Adapter
from dcpkit.convert.adapters.hf import HFNamesAdapter
from dcpkit.convert.adapters.llama3 import Llama3Adapter
from dcpkit.convert.adapters.qwen3 import Qwen3Adapter
from dcpkit.convert.adapters.qwen3_moe import Qwen3MoeAdapter

_ADAPTERS: dict[str, ModelAdapter] = {
    a.family: a
    for a in (
        Llama3Adapter(),
        Qwen3Adapter(),
        Qwen3MoeAdapter(),
        DeepSeekV3Adapter(),
        HFNamesAdapter(),
    )
}


def get_adapter(family: str) -> ModelAdapter:
    try:
        return _ADAPTERS[family]
    except KeyError:
        raise ConversionError(
            f"unknown model family {family!r}; known families: {', '.join(sorted(_ADAPTERS))}"
        ) from None


def known_families() -> list[str]:
    return sorted(_ADAPTERS)


__all__ = [
    "ConversionError",
    "ExpertOf",
    "KeyPlan",
    "ModelAdapter",
    "RopePermute",
    "get_adapter",
    "known_families",
]
