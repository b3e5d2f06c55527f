"""Qwen 3 (dense) with TorchTitan's parameter names, math and flavors.

Names as in Llama 3 (``tok_embeddings``, ``layers.{i}.attention.{wq,wk,wv,wo}``,
``layers.{i}.feed_forward.{w1,w2,w3}``, ``layers.{i}.{attention,ffn}_norm``, ``norm``,
``output``) plus ``layers.{i}.attention.{q_norm,k_norm}``: an RMSNorm over each head of the
queries and keys, before RoPE. RoPE rotates halves (as HF does); ``head_dim`` is given, not
``dim // n_heads``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dcpkit.models import llama3
from dcpkit.models.llama3 import build_decoder


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

    @property
    def ffn_hidden_dim(self) -> int:
        return self.hidden_dim

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


class Attention(llama3.Attention):
    qk_norm = True
    rotate = staticmethod(apply_rotary_emb)


class TransformerBlock(llama3.TransformerBlock):
    attention_cls = Attention


class Qwen3(llama3.Llama3):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``; the RoPE table
    (``freqs_cis``) holds cos and sin (``precompute_rope_cache``)."""

    block_cls = TransformerBlock
    precompute_rope = staticmethod(precompute_rope_cache)


def build_qwen3(flavor: str | Qwen3Args, **overrides: object) -> Qwen3:
    """Build a Qwen 3 model of a named flavor (or explicit args), with field overrides."""
    return build_decoder(Qwen3, "qwen3", QWEN3_FLAVORS, flavor, overrides)
