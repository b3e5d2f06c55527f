"""Qwen 3 mixture-of-experts (``Qwen3MoeForCausalLM``) with TorchTitan's parameter names and math.

Attention as in dense Qwen 3 (q/k norms, rotate-half RoPE); every layer's FFN is a MoE
(``layers.{i}.moe.router.gate``, ``layers.{i}.moe.experts.{w1,w2,w3}``): softmax over all
experts, top-k, the chosen weights renormalized (``norm_topk_prob``), no shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcpkit.models import llama3, qwen3
from dcpkit.models.llama3 import build_decoder
from dcpkit.models.moe import MoEArgs, MoEBlock


@dataclass(frozen=True)
class Qwen3MoeArgs:
    """Shape and numerics of one Qwen 3 MoE model."""

    dim: int = 2048
    """Hidden size."""
    n_layers: int = 48
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads."""
    n_kv_heads: int = 4
    """Key/value heads."""
    head_dim: int = 128
    """Per-head size."""
    vocab_size: int = 151936
    """Vocabulary size."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1000000.0
    """RoPE base frequency (rotate-half RoPE, as in HF)."""
    max_seq_len: int = 40960
    """Longest context."""
    tie_word_embeddings: bool = False
    """Share the output projection with the token embedding."""
    hidden_dim: int = 6144
    """Dense FFN size (``intermediate_size``; used by the first ``n_dense_layers`` only)."""
    n_dense_layers: int = 0
    """Leading layers with a dense FFN instead of a MoE."""
    moe: MoEArgs = field(
        default_factory=lambda: MoEArgs(
            num_experts=128, hidden_dim=768, top_k=8, score_func="softmax", route_norm=True
        )
    )
    """The MoE layers."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )


QWEN3_MOE_FLAVORS: dict[str, Qwen3MoeArgs] = {
    "debugmodel": Qwen3MoeArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        vocab_size=2048,
        hidden_dim=768,
        moe=MoEArgs(num_experts=8, hidden_dim=128, top_k=2, route_norm=True),
    ),
    "30B-A3B": Qwen3MoeArgs(),
    "235B-A22B": Qwen3MoeArgs(
        dim=4096,
        n_layers=94,
        n_heads=64,
        n_kv_heads=4,
        hidden_dim=12288,
        moe=MoEArgs(num_experts=128, hidden_dim=1536, top_k=8, route_norm=True),
    ),
}


class TransformerBlock(MoEBlock):
    attention_cls = qwen3.Attention


class Qwen3Moe(llama3.Llama3):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``."""

    block_cls = TransformerBlock  # type: ignore[assignment]
    precompute_rope = staticmethod(qwen3.precompute_rope_cache)


def build_qwen3_moe(flavor: str | Qwen3MoeArgs, **overrides: object) -> Qwen3Moe:
    """Build a Qwen 3 MoE model of a named flavor (or explicit args), with field overrides."""
    return build_decoder(Qwen3Moe, "qwen3_moe", QWEN3_MOE_FLAVORS, flavor, overrides)
