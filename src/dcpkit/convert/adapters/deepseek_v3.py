"""DeepSeek-V3: TorchTitan <-> Hugging Face ``DeepseekV3ForCausalLM``.

Multi-head latent attention keys, dense leading layers, MoE layers with shared experts and the
router's ``expert_bias`` (HF: ``mlp.gate.e_score_correction_bias``, a buffer it loads and saves).
No RoPE permutation: HF's model reads interleaved rope dims (``rope_interleave``). Published
checkpoints carry a multi-token-prediction layer after the last one (``num_nextn_predict_layers``);
transformers' model does not use it, and an import drops it, listed.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch

from dcpkit.convert.adapters.base import (
    ConversionError,
    KeyPlan,
    ModelAdapter,
    check_model_type,
    decoder_hf_config,
)
from dcpkit.convert.adapters.llama3 import Llama3Adapter
from dcpkit.convert.adapters.moe import (
    MOE_KEY_MAP,
    SHARED_EXPERTS_KEY_MAP,
    moe_layer_shapes,
)
from dcpkit.models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Args
from dcpkit.models.moe import MoEArgs
from dcpkit.spellings import MOE_ALIASES

_SHARED = (
    "tok_embeddings.weight",
    "norm.weight",
    "output.weight",
    "layers.{i}.attention_norm.weight",
    "layers.{i}.ffn_norm.weight",
    "layers.{i}.feed_forward.w1.weight",
    "layers.{i}.feed_forward.w2.weight",
    "layers.{i}.feed_forward.w3.weight",
)
_ATTN = "model.layers.{i}.self_attn."
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepSeekV3Adapter(ModelAdapter):
    family = "deepseek_v3"
    key_map: ClassVar[dict[str, str]] = {
        **{k: Llama3Adapter.key_map[k] for k in _SHARED},
        "layers.{i}.attention.wq.weight": _ATTN + "q_proj.weight",
        "layers.{i}.attention.wq_a.weight": _ATTN + "q_a_proj.weight",
        "layers.{i}.attention.q_norm.weight": _ATTN + "q_a_layernorm.weight",
        "layers.{i}.attention.wq_b.weight": _ATTN + "q_b_proj.weight",
        "layers.{i}.attention.wkv_a.weight": _ATTN + "kv_a_proj_with_mqa.weight",
        "layers.{i}.attention.kv_norm.weight": _ATTN + "kv_a_layernorm.weight",
        "layers.{i}.attention.wkv_b.weight": _ATTN + "kv_b_proj.weight",
        "layers.{i}.attention.wo.weight": _ATTN + "o_proj.weight",
        **MOE_KEY_MAP,
        **SHARED_EXPERTS_KEY_MAP,
        "layers.{i}.moe.expert_bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
    }
    aliases: ClassVar[dict[str, str]] = dict(MOE_ALIASES)
    hf_ignored = ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)
    flavors = DEEPSEEK_V3_FLAVORS

    def expected_shapes(self, args: DeepSeekV3Args) -> dict[str, tuple[int, ...]]:
        qk, d = args.qk_head_dim, args.dim
        shapes: dict[str, tuple[int, ...]] = {
            "tok_embeddings.weight": (args.vocab_size, d),
            "norm.weight": (d,),
            "output.weight": (args.vocab_size, d),
        }
        for i in range(args.n_layers):
            p = f"layers.{i}."
            a = p + "attention."
            if args.q_lora_rank == 0:
                shapes[a + "wq.weight"] = (args.n_heads * qk, d)
            else:
                shapes[a + "wq_a.weight"] = (args.q_lora_rank, d)
                shapes[a + "q_norm.weight"] = (args.q_lora_rank,)
                shapes[a + "wq_b.weight"] = (args.n_heads * qk, args.q_lora_rank)
            shapes[a + "wkv_a.weight"] = (args.kv_lora_rank + args.qk_rope_head_dim, d)
            shapes[a + "kv_norm.weight"] = (args.kv_lora_rank,)
            shapes[a + "wkv_b.weight"] = (
                args.n_heads * (args.qk_nope_head_dim + args.v_head_dim),
                args.kv_lora_rank,
            )
            shapes[a + "wo.weight"] = (d, args.n_heads * args.v_head_dim)
            shapes[p + "attention_norm.weight"] = (d,)
            shapes[p + "ffn_norm.weight"] = (d,)
            shapes.update(moe_layer_shapes(args, i))
        return shapes

    def plan_from_hf(
        self, shapes: dict[str, tuple[int, ...]], args: Any, flavor: str, where: str
    ) -> KeyPlan:
        kept, mtp = {}, []
        for key, shape in shapes.items():
            m = _LAYER.match(key)
            if m and int(m.group(1)) >= args.n_layers:
                mtp.append((key, "multi-token-prediction layer (unused by DeepseekV3ForCausalLM)"))
            else:
                kept[key] = shape
        plan = super().plan_from_hf(kept, args, flavor, where)
        plan.dropped += mtp
        return plan

    def hf_config(
        self, args: DeepSeekV3Args, dtype: torch.dtype, bos: int | None, eos: int | None
    ) -> dict:
        m = args.moe
        if m.score_func != "sigmoid":
            raise ConversionError(
                "transformers' DeepseekV3 routes by sigmoid scores; this model routes by "
                f"{m.score_func} and cannot be exported as deepseek_v3"
            )
        rope_scaling = None
        if args.rope_factor > 1:
            rope_scaling = {
                "type": "yarn",
                "rope_type": "yarn",
                "factor": args.rope_factor,
                "beta_fast": args.beta_fast,
                "beta_slow": args.beta_slow,
                "mscale": args.mscale,
                "mscale_all_dim": args.mscale,
                "original_max_position_embeddings": args.original_seq_len,
            }
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            # head_dim: the rope part of a head, as transformers' DeepseekV3Config defines it.
            **decoder_hf_config(args, args.hidden_dim, args.qk_rope_head_dim, dtype, bos, eos),
            "moe_intermediate_size": m.hidden_dim,
            "n_shared_experts": m.num_shared_experts,
            "n_routed_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "routed_scaling_factor": m.route_scale,
            "n_group": m.num_expert_groups or 1,
            "topk_group": m.num_limited_groups or 1,
            "norm_topk_prob": m.route_norm,
            "first_k_dense_replace": args.n_dense_layers,
            "q_lora_rank": args.q_lora_rank or None,
            "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim,
            "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim,
            "rope_interleave": True,
            "rope_scaling": rope_scaling,
            "num_nextn_predict_layers": 0,
        }

    def args_from_hf_config(self, config: dict[str, Any]) -> DeepSeekV3Args:
        check_model_type(self.family, config)
        rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
        yarn = (rope.get("rope_type") or rope.get("type")) == "yarn"
        mscale = float(rope.get("mscale_all_dim") or 1.0) if yarn else 1.0
        if yarn and float(rope.get("mscale") or mscale) != mscale:
            raise ConversionError(
                "config.json's YaRN mscale differs from mscale_all_dim (a scaled rotary "
                "embedding), which deepseek_v3 does not model"
            )
        groups = int(config.get("n_group") or 1)
        args = DeepSeekV3Args(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"],
            vocab_size=config["vocab_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            hidden_dim=config["intermediate_size"],
            n_dense_layers=int(config.get("first_k_dense_replace", 0)),
            moe=MoEArgs(
                num_experts=config["n_routed_experts"],
                hidden_dim=config["moe_intermediate_size"],
                top_k=config["num_experts_per_tok"],
                num_shared_experts=int(config.get("n_shared_experts") or 0),
                score_func="sigmoid",
                route_norm=bool(config.get("norm_topk_prob", True)),
                route_scale=float(config.get("routed_scaling_factor", 1.0)),
                num_expert_groups=groups if groups > 1 else None,
                num_limited_groups=int(config.get("topk_group") or 1) if groups > 1 else None,
                load_balance_coeff=1e-3,
            ),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta", 10000.0)),
            rope_factor=float(rope.get("factor", 1.0)) if yarn else 1.0,
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            original_seq_len=int(rope.get("original_max_position_embeddings") or 4096),
            mscale=mscale,
            max_seq_len=config.get("max_position_embeddings", 163840),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )
        return self.known_flavor(args)
