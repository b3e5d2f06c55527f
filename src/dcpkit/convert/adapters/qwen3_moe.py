"""Qwen 3 MoE: TorchTitan <-> Hugging Face ``Qwen3MoeForCausalLM``. Stacked experts become one
HF tensor per expert and back; no RoPE permutation (both rotate halves)."""

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
from dcpkit.convert.adapters.moe import (
    MOE_KEY_MAP,
    leading_dense_layers,
    moe_layer_shapes,
)
from dcpkit.convert.adapters.qwen3 import Qwen3Adapter, qwen3_fields
from dcpkit.models.moe import MoEArgs
from dcpkit.models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeArgs
from dcpkit.spellings import MOE_ALIASES


class Qwen3MoeAdapter(ModelAdapter):
    family = "qwen3_moe"
    key_map: ClassVar[dict[str, str]] = {**Qwen3Adapter.key_map, **MOE_KEY_MAP}
    aliases: ClassVar[dict[str, str]] = {**Qwen3Adapter.aliases, **MOE_ALIASES}
    hf_ignored = Qwen3Adapter.hf_ignored
    flavors = QWEN3_MOE_FLAVORS

    def expected_shapes(self, args: Qwen3MoeArgs) -> dict[str, tuple[int, ...]]:
        norms = {
            "attention.q_norm.weight": (args.head_dim,),
            "attention.k_norm.weight": (args.head_dim,),
        }
        shapes = decoder_shapes(
            args.vocab_size,
            args.dim,
            args.n_layers,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            args.hidden_dim,
            norms,
        )
        for i in range(args.n_layers):
            for w in ("w1", "w2", "w3"):
                del shapes[f"layers.{i}.feed_forward.{w}.weight"]
            shapes.update(moe_layer_shapes(args, i))
        return shapes

    def hf_config(
        self, args: Qwen3MoeArgs, dtype: torch.dtype, bos: int | None, eos: int | None
    ) -> dict:
        m = args.moe
        if m.score_func != "softmax" or m.num_shared_experts or m.load_balance_coeff is not None:
            raise ConversionError(
                "transformers' Qwen3Moe routes by softmax, without shared experts or expert "
                "bias; this model's MoE cannot be exported as qwen3_moe"
            )
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **decoder_hf_config(args, args.hidden_dim, args.head_dim, dtype, bos, eos),
            "moe_intermediate_size": m.hidden_dim,
            "num_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "norm_topk_prob": m.route_norm,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(args.n_dense_layers)),
            "router_aux_loss_coef": 0.001,
            "output_router_logits": False,
            "rope_scaling": None,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": args.n_layers,
        }

    def args_from_hf_config(self, config: dict[str, Any]) -> Qwen3MoeArgs:
        check_model_type(self.family, config)
        experts = config.get("num_experts") or config["num_local_experts"]
        args = Qwen3MoeArgs(
            **qwen3_fields(config, tie_default=False),
            n_dense_layers=leading_dense_layers(config, self.family),
            moe=MoEArgs(
                num_experts=int(experts),
                hidden_dim=config["moe_intermediate_size"],
                top_k=config["num_experts_per_tok"],
                score_func="softmax",
                route_norm=bool(config.get("norm_topk_prob", False)),
            ),
        )
        return self.known_flavor(args)
