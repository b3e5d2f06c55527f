"""Llama 3: TorchTitan <-> Hugging Face ``LlamaForCausalLM``."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from dcpkit.convert.adapters.base import (
    ConversionError,
    ModelAdapter,
    RopePermute,
    check_model_type,
    decoder_hf_config,
    decoder_shapes,
)
from dcpkit.models.llama3 import LLAMA3_FLAVORS, Llama3Args, rope_scaling_dict
from dcpkit.spellings import LLAMA3_ALIASES


class Llama3Adapter(ModelAdapter):
    family = "llama3"
    key_map: ClassVar[dict[str, str]] = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
        "layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
        "layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
        "layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
        "layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
        "layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
        "layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
        "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
        "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
        "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    aliases: ClassVar[dict[str, str]] = LLAMA3_ALIASES
    hf_ignored = ("model.layers.{i}.self_attn.rotary_emb.inv_freq",)
    flavors = LLAMA3_FLAVORS

    def transform(self, canonical_key: str, args: Llama3Args) -> Any:
        if canonical_key.endswith((".attention.wq.weight", ".attention.wk.weight")):
            return RopePermute(args.head_dim)
        return None

    def expected_shapes(self, args: Llama3Args) -> dict[str, tuple[int, ...]]:
        return decoder_shapes(
            args.vocab_size,
            args.dim,
            args.n_layers,
            args.n_heads,
            args.kv_heads,
            args.head_dim,
            args.ffn_hidden_dim,
        )

    def hf_config(
        self, args: Llama3Args, dtype: torch.dtype, bos: int | None, eos: int | None
    ) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **decoder_hf_config(args, args.ffn_hidden_dim, args.head_dim, dtype, bos, eos),
            "rope_scaling": {"rope_type": "llama3", **rope_scaling_dict()}
            if args.rope_scaling
            else None,
            "mlp_bias": False,
            "pretraining_tp": 1,
        }

    def args_from_hf_config(self, config: dict[str, Any]) -> Llama3Args:
        check_model_type(self.family, config)
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or (
            rope if rope.get("rope_type") == "llama3" else None
        )
        if scaling:
            kind = scaling.get("rope_type") or scaling.get("type")
            theirs = {k: float(scaling[k]) for k in rope_scaling_dict() if k in scaling}
            ours = {k: float(v) for k, v in rope_scaling_dict().items()}
            if kind != "llama3" or theirs != ours:
                raise ConversionError(
                    f"config.json rope scaling {scaling} is not Llama 3.1's {ours}; dcpkit's "
                    "llama3 model implements only that scaling"
                )
        dim, heads = config["hidden_size"], config["num_attention_heads"]
        head_dim = config.get("head_dim") or dim // heads
        if head_dim != dim // heads:
            raise ConversionError(
                f"config.json head_dim {head_dim} differs from hidden_size / num_attention_heads "
                f"({dim // heads}); dcpkit's llama3 model derives head_dim"
            )
        args = Llama3Args(
            dim=dim,
            n_layers=config["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads", heads),
            vocab_size=config["vocab_size"],
            norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=float(config.get("rope_theta") or rope.get("rope_theta", 500000.0)),
            rope_scaling=bool(scaling),
            max_seq_len=config.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            hidden_dim=config["intermediate_size"],
        )
        # Prefer the named flavor when the shapes and numerics are one of them.
        for known in self.flavors.values():
            if _same_model(known, args):
                return known
        return args


def _same_model(a: Llama3Args, b: Llama3Args) -> bool:
    fields = (
        "dim",
        "n_layers",
        "n_heads",
        "kv_heads",
        "vocab_size",
        "ffn_hidden_dim",
        "norm_eps",
        "rope_theta",
        "rope_scaling",
        "tie_word_embeddings",
    )
    return all(getattr(a, f) == getattr(b, f) for f in fields)
