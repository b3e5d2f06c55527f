"""Qwen 3 (dense): TorchTitan <-> Hugging Face ``Qwen3ForCausalLM``. No RoPE permutation:
TorchTitan's qwen3 already rotates halves, as HF does."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dcpkit.convert.adapters.base import (
    ConversionError,
    ModelAdapter,
    check_model_type,
    decoder_hf_config,
    decoder_shapes,
)
from dcpkit.convert.adapters.llama3 import Llama3Adapter
from dcpkit.models.qwen3 import QWEN3_FLAVORS, Qwen3Args
from dcpkit.spellings import QWEN3_ALIASES


class Qwen3Adapter(ModelAdapter):
    family = "qwen3"
    key_map: ClassVar[dict[str, str]] = {
        **Llama3Adapter.key_map,
        "layers.{i}.attention.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
        "layers.{i}.attention.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    }
    aliases: ClassVar[dict[str, str]] = QWEN3_ALIASES
    hf_ignored = Llama3Adapter.hf_ignored
    flavors = QWEN3_FLAVORS

    def resolve_flavor(self, flavor: str) -> Qwen3Args:
        from dcpkit.models.qwen3_moe import QWEN3_MOE_FLAVORS

        if flavor in QWEN3_MOE_FLAVORS and flavor not in self.flavors:
            raise ConversionError(
                f"{flavor} is a Qwen 3 mixture-of-experts flavor (TorchTitan lists it under "
                "qwen3); convert it with --model qwen3_moe"
            )
        return super().resolve_flavor(flavor)

    def expected_shapes(self, args: Qwen3Args) -> dict[str, tuple[int, ...]]:
        norms = {
            "attention.q_norm.weight": (args.head_dim,),
            "attention.k_norm.weight": (args.head_dim,),
        }
        return decoder_shapes(
            args.vocab_size,
            args.dim,
            args.n_layers,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            args.hidden_dim,
            norms,
        )

    def hf_config(
        self, args: Qwen3Args, dtype: torch.dtype, bos: int | None, eos: int | None
    ) -> dict:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **decoder_hf_config(args, args.hidden_dim, args.head_dim, dtype, bos, eos),
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
        }

    def args_from_hf_config(self, config: dict[str, Any]) -> Qwen3Args:
        check_model_type(self.family, config)
        return self.known_flavor(Qwen3Args(**qwen3_fields(config, tie_default=True)))


def qwen3_fields(config: dict[str, Any], tie_default: bool) -> dict[str, Any]:
    """The Qwen 3 attention, norm and embedding fields of an HF ``config.json``."""
    rope = config.get("rope_parameters") or {}
    return {
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": config["num_attention_heads"],
        "n_kv_heads": config.get("num_key_value_heads", config["num_attention_heads"]),
        "head_dim": config.get("head_dim")
        or config["hidden_size"] // config["num_attention_heads"],
        "hidden_dim": config["intermediate_size"],
        "vocab_size": config["vocab_size"],
        "norm_eps": config.get("rms_norm_eps", 1e-6),
        "rope_theta": float(config.get("rope_theta") or rope.get("rope_theta", 1e6)),
        "max_seq_len": config.get("max_position_embeddings", 40960),
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", tie_default)),
    }
