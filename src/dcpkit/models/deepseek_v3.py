"""DeepSeek-V3 with TorchTitan's parameter names and math.

Multi-head latent attention: queries through ``attention.wq`` or, with ``q_lora_rank``, the
low-rank ``wq_a`` -> ``q_norm`` -> ``wq_b``; keys and values from one low-rank latent
(``wkv_a`` -> ``kv_norm`` -> ``wkv_b``) plus a single RoPE key head shared by all heads. RoPE
rotates interleaved pairs (TorchTitan's complex form) with YaRN frequency scaling, and the
softmax scale takes YaRN's ``mscale`` squared. The first ``n_dense_layers`` have a dense
``feed_forward``; the others a MoE with shared experts and sigmoid routing: expert bias for the
choice (auxiliary-loss-free load balancing), group-limited top-k, weights renormalized and
scaled.

YaRN applies whenever ``rope_factor > 1``, as in Hugging Face's model (TorchTitan applies it
only when the training context exceeds ``original_seq_len``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dcpkit.models import llama3
from dcpkit.models.llama3 import RMSNorm, build_decoder
from dcpkit.models.moe import MoEArgs, MoEBlock


@dataclass(frozen=True)
class DeepSeekV3Args:
    """Shape and numerics of one DeepSeek-V3 model."""

    dim: int = 7168
    """Hidden size."""
    n_layers: int = 61
    """Number of transformer blocks."""
    n_heads: int = 128
    """Attention heads."""
    vocab_size: int = 129280
    """Vocabulary size."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    q_lora_rank: int = 1536
    """Rank of the low-rank query projection; 0: a full ``wq``."""
    kv_lora_rank: int = 512
    """Rank of the key/value latent."""
    qk_nope_head_dim: int = 128
    """Per-head query/key size without RoPE."""
    qk_rope_head_dim: int = 64
    """Per-head query/key size with RoPE."""
    v_head_dim: int = 128
    """Per-head value size."""
    hidden_dim: int = 18432
    """FFN size of the dense layers."""
    n_dense_layers: int = 3
    """Leading layers with a dense FFN."""
    moe: MoEArgs = field(
        default_factory=lambda: MoEArgs(
            num_experts=256,
            hidden_dim=2048,
            top_k=8,
            num_shared_experts=1,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=8,
            num_limited_groups=4,
            load_balance_coeff=1e-3,
        )
    )
    """The MoE layers."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_factor: float = 40.0
    """YaRN context-extension factor; 1 disables YaRN."""
    beta_fast: float = 32.0
    """YaRN ramp: rotations above which frequencies are kept."""
    beta_slow: float = 1.0
    """YaRN ramp: rotations below which frequencies are interpolated."""
    original_seq_len: int = 4096
    """Context the model was pretrained with (YaRN)."""
    mscale: float = 1.0
    """YaRN attention-scale coefficient."""
    max_seq_len: int = 163840
    """Positions for which RoPE is precomputed."""
    tie_word_embeddings: bool = False
    """Share the output projection with the token embedding (never, for published models)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_heads

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")


def _flavor(**kw: object) -> DeepSeekV3Args:
    return DeepSeekV3Args(**kw)  # type: ignore[arg-type]


DEEPSEEK_V3_FLAVORS: dict[str, DeepSeekV3Args] = {
    "debugmodel": _flavor(
        dim=256,
        n_layers=3,
        n_heads=8,
        vocab_size=2048,
        q_lora_rank=64,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        hidden_dim=768,
        n_dense_layers=1,
        moe=MoEArgs(
            num_experts=8,
            hidden_dim=128,
            top_k=3,
            num_shared_experts=2,
            score_func="sigmoid",
            route_norm=True,
            route_scale=2.5,
            num_expert_groups=4,
            num_limited_groups=2,
            load_balance_coeff=1e-3,
        ),
        mscale=0.707,
        max_seq_len=163840,
    ),
    # TorchTitan's 16B shapes (DeepSeek-V2-Lite class), routed as V3 is: sigmoid scores.
    "16B": _flavor(
        dim=2048,
        n_layers=27,
        n_heads=16,
        vocab_size=102400,
        q_lora_rank=0,
        hidden_dim=10944,
        n_dense_layers=1,
        moe=MoEArgs(
            num_experts=64,
            hidden_dim=1408,
            top_k=6,
            num_shared_experts=2,
            score_func="sigmoid",
            route_norm=True,
            route_scale=1.0,
            load_balance_coeff=1e-3,
        ),
        mscale=0.707,
        max_seq_len=163840,
    ),
    "671B": DeepSeekV3Args(),
}


def yarn_inv_freq(args: DeepSeekV3Args) -> torch.Tensor:
    """RoPE inverse frequencies of the rope head dims, YaRN-scaled when ``rope_factor > 1``."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if args.rope_factor <= 1:
        return extrapolation
    interpolation = 1.0 / (args.rope_factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(args.original_seq_len / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low = max(math.floor(correction_dim(args.beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def precompute_freqs_cis(args: DeepSeekV3Args, seq_len: int | None = None) -> torch.Tensor:
    """Complex rotations ``[seq_len, qk_rope_head_dim // 2]``."""
    inv_freq = yarn_inv_freq(args)
    end = args.max_seq_len if seq_len is None else seq_len
    angles = torch.outer(torch.arange(end, dtype=torch.float32), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def softmax_scale(args: DeepSeekV3Args) -> float:
    scale = args.qk_head_dim**-0.5
    if args.rope_factor > 1:
        m = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
        scale *= m * m
    return scale


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` ``[bs, seq, heads, d]``."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, xc.shape[-1])
    return torch.view_as_real(xc * freqs).flatten(3).type_as(x)


class Attention(nn.Module):
    """Multi-head latent attention."""

    def __init__(self, args: DeepSeekV3Args) -> None:
        super().__init__()
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.nope, self.rope, self.v_dim = (
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
        )
        qk = args.qk_head_dim
        if self.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, args.n_heads * qk, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, args.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, args.norm_eps)
        self.wkv_b = nn.Linear(
            args.kv_lora_rank, args.n_heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.wo = nn.Linear(args.n_heads * args.v_head_dim, args.dim, bias=False)
        self.softmax_scale = softmax_scale(args)

    def init_weights(self, init_std: float) -> None:
        names = ["wkv_a", "wkv_b"] + (["wq"] if self.q_lora_rank == 0 else ["wq_a", "wq_b"])
        for name in names:
            nn.init.trunc_normal_(getattr(self, name).weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.kv_norm.reset_parameters()
        if self.q_lora_rank:
            self.q_norm.reset_parameters()

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(bs, seq, -1, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat([q_nope, _rotate(q_pe, freqs_cis)], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        k_pe = _rotate(k_pe.unsqueeze(2), freqs_cis)
        kv = self.wkv_b(self.kv_norm(kv)).view(bs, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.softmax_scale,
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class TransformerBlock(MoEBlock):
    attention_cls = Attention


class DeepSeekV3(llama3.Llama3):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``."""

    block_cls = TransformerBlock  # type: ignore[assignment]
    precompute_rope = staticmethod(precompute_freqs_cis)


def build_deepseek_v3(flavor: str | DeepSeekV3Args, **overrides: object) -> DeepSeekV3:
    """Build a DeepSeek-V3 model of a named flavor (or explicit args), with field overrides."""
    return build_decoder(DeepSeekV3, "deepseek_v3", DEEPSEEK_V3_FLAVORS, flavor, overrides)
