"""Qwen 3 (dense) shapes with TorchTitan's flavors, for conversion and validation."""

from __future__ import annotations

from dataclasses import dataclass


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
