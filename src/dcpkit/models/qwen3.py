"""Qwen 3 (dense) with TorchTitan's parameter names, math and flavors.

Names as in Llama 3 (``tok_embeddings``, ``layers.{i}.attention.{wq,wk,wv,wo}``,
``layers.{i}.feed_forward.{w1,w2,w3}``, ``layers.{i}.{attention,ffn}_norm``, ``norm``,
``output``) plus ``layers.{i}.attention.{q_norm,k_norm}``: an RMSNorm over each head of the
queries and keys, before RoPE. RoPE rotates halves (as HF does); ``head_dim`` is given, not
``dim // n_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from dcpkit.models.llama3 import FeedForward, RMSNorm


@dataclass(frozen=True)
class Qwen3Args:
    """Shape and numerics of one Qwen 3 dense model."""

    dim: int = 1024
    """Hidden size."""
    n_layers: int = 28
    """Number of transformer blocks."""
    n_heads: int = 16
    """Query heads."""
    n_kv_heads: int = 8
    """Key/value heads."""
    head_dim: int = 128
    """Per-head size (given, not dim // n_heads)."""
    hidden_dim: int = 3072
    """FFN hidden size."""
    vocab_size: int = 151936
    """Vocabulary size."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1000000.0
    """RoPE base frequency (rotate-half RoPE, as in HF)."""
    max_seq_len: int = 40960
    """Longest context."""
    tie_word_embeddings: bool = True
    """Share the output projection with the token embedding."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(
        dim=256,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=3072,
        vocab_size=2048,
    ),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072),
    "1.7B": Qwen3Args(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144),
    "4B": Qwen3Args(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728),
    "8B": Qwen3Args(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288, tie_word_embeddings=False),
    "14B": Qwen3Args(
        dim=5120, n_layers=40, n_heads=40, hidden_dim=17408, tie_word_embeddings=False
    ),
    "32B": Qwen3Args(
        dim=5120, n_layers=64, n_heads=64, hidden_dim=25600, tie_word_embeddings=False
    ),
}


def precompute_rope_cache(args: Qwen3Args, seq_len: int | None = None) -> torch.Tensor:
    """``[seq_len, 2 * head_dim]``: cos then sin, each over the whole head (halves repeated)."""
    dim = args.head_dim
    end = args.max_seq_len if seq_len is None else seq_len
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    angles = torch.outer(torch.arange(end, dtype=torch.float32, device=freqs.device), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, rope_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the halves of ``xq``/``xk`` ``[bs, seq, heads, head_dim]``."""
    head_dim = xq.shape[-1]
    cache = rope_cache[: xq.shape[1]].view(1, xq.shape[1], 1, 2 * head_dim)
    cos, sin = cache[..., :head_dim], cache[..., head_dim:]
    xq_out = xq.float() * cos + _rotate_half(xq.float()) * sin
    xk_out = xk.float() * cos + _rotate_half(xk.float()) * sin
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps)
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        xq = self.q_norm(self.wq(x).view(bs, seq_len, -1, self.head_dim))
        xk = self.k_norm(self.wk(x).view(bs, seq_len, -1, self.head_dim))
        xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache)
        if self.n_rep > 1:
            xk = xk.repeat_interleave(self.n_rep, dim=2)
            xv = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: Qwen3Args) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Qwen3(nn.Module):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope_cache", precompute_rope_cache(args), persistent=False)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer (also after ``to_empty`` from meta)."""
        device = buffer_device or self.rope_cache.device
        with torch.device(device):
            self.rope_cache = precompute_rope_cache(self.args)
        # Tied embeddings take the output projection's init (as in TorchTitan): a unit-normal
        # embedding used as the output would start with enormous logits.
        if not self.args.tie_word_embeddings:
            nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_weights()
        self.norm.reset_parameters()
        std = self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h, self.rope_cache)
        return self.output(self.norm(h))


def build_qwen3(flavor: str | Qwen3Args, **overrides: object) -> Qwen3:
    """Build a Qwen 3 model of a named flavor (or explicit args), with field overrides."""
    if isinstance(flavor, Qwen3Args):
        args = flavor
    else:
        try:
            args = QWEN3_FLAVORS[flavor]
        except KeyError:
            known = ", ".join(QWEN3_FLAVORS)
            raise ValueError(f"unknown qwen3 flavor {flavor!r}; known flavors: {known}") from None
    if overrides:
        args = replace(args, **overrides)
    model = Qwen3(args)
    if not any(p.is_meta for p in model.parameters()):
        model.init_weights()
    return model
