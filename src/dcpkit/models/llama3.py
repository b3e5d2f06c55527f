"""Llama 3 with TorchTitan's parameter names and math.

Parameter names match TorchTitan's ``torchtitan/models/llama3/model.py`` so that checkpoints
move between the two without renaming: ``tok_embeddings``, ``layers.{i}.attention.{wq,wk,wv,wo}``,
``layers.{i}.feed_forward.{w1,w2,w3}``, ``layers.{i}.{attention,ffn}_norm``, ``norm``, ``output``.
RoPE rotates interleaved pairs as complex numbers (TorchTitan's convention, not HF's halves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Llama3Args:
    """Shape and numerics of one Llama 3 model."""

    dim: int = 4096
    """Hidden size."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Attention (query) heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means ``n_heads``."""
    vocab_size: int = 128256
    """Vocabulary size (rows of the embedding and of the output projection)."""
    multiple_of: int = 256
    """The FFN hidden size is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Optional multiplier applied to ``int(2 * 4 * dim / 3)`` before rounding."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    rope_scaling: bool = True
    """Apply Llama 3.1 frequency scaling (factor 8, low 1, high 4, original context 8192)."""
    max_seq_len: int = 131072
    """Positions for which RoPE frequencies are precomputed."""
    tie_word_embeddings: bool = False
    """Share the output projection with the token embedding."""
    hidden_dim: int | None = None
    """Explicit FFN hidden size (for imported models); None applies the rule above."""

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        if self.hidden_dim is not None:
            return self.hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")


_ROPE_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

LLAMA3_FLAVORS: dict[str, Llama3Args] = {
    "debugmodel": Llama3Args(dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256),
    # Not a released size: a model whose training step on a CPU outlasts the copy of its state
    # (192 M parameters, 2.3 GB with AdamW), for measuring what a checkpoint costs a step.
    "200M": Llama3Args(
        dim=1536,
        n_layers=6,
        n_heads=12,
        n_kv_heads=4,
        vocab_size=2048,
        ffn_dim_multiplier=1.3,
        multiple_of=256,
    ),
    "1B": Llama3Args(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=1024,
        tie_word_embeddings=True,
    ),
    "3B": Llama3Args(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=1024,
        tie_word_embeddings=True,
    ),
    "8B": Llama3Args(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
    ),
    "70B": Llama3Args(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
    ),
    "405B": Llama3Args(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim_multiplier=1.2,
        multiple_of=4096,
    ),
    # Not a released size: a debug model whose head size (32) vLLM's CPU attention takes (16,
    # debugmodel's, it does not), for pushing a run's weights into a vLLM engine on a CPU.
    "debugmodel_h32": Llama3Args(
        dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512, multiple_of=256
    ),
}


def rope_scaling_dict() -> dict[str, float]:
    """Llama 3.1 RoPE scaling as numbers (the same ones ``config.json`` carries)."""
    return dict(_ROPE_SCALING)


def _scale_frequencies(freqs: torch.Tensor) -> torch.Tensor:
    factor = _ROPE_SCALING["factor"]
    low = _ROPE_SCALING["low_freq_factor"]
    high = _ROPE_SCALING["high_freq_factor"]
    old_len = _ROPE_SCALING["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * freqs / factor + smooth * freqs
    return torch.where(
        wavelen < high_freq_wavelen,
        freqs,
        torch.where(wavelen > low_freq_wavelen, freqs / factor, mid),
    )


def precompute_freqs_cis(args: Llama3Args, seq_len: int | None = None) -> torch.Tensor:
    """Complex rotations ``[seq_len, head_dim // 2]`` (TorchTitan's interleaved RoPE)."""
    dim = args.head_dim
    end = args.max_seq_len if seq_len is None else seq_len
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    if args.rope_scaling:
        freqs = _scale_frequencies(freqs)
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    angles = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate interleaved pairs of ``xq``/``xk`` ``[bs, seq, heads, head_dim]``."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq.shape[1]].view(1, xq.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    """Grouped-query attention. Subclasses choose the RoPE (``rotate``) and may add an RMSNorm
    over each query and key head before it (``qk_norm``, as Qwen 3 does)."""

    qk_norm = False

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.head_dim = args.head_dim
        self.n_rep = args.n_heads // args.kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)

    @staticmethod
    def rotate(
        xq: torch.Tensor, xk: torch.Tensor, rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_emb(xq, xk, rope)

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        if self.qk_norm:
            self.q_norm.reset_parameters()
            self.k_norm.reset_parameters()

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq_len, _ = x.shape
        # -1 rather than n_heads: under tensor parallelism each rank holds a slice of the heads.
        xq = self.wq(x).view(bs, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bs, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bs, seq_len, -1, self.head_dim)
        if self.qk_norm:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = self.rotate(xq, xk, rope)
        if self.n_rep > 1:
            xk = xk.repeat_interleave(self.n_rep, dim=2)
            xv = xv.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bs, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    attention_cls: type[Attention] = Attention

    def __init__(self, layer_id: int, args: Llama3Args) -> None:
        super().__init__()
        self.attention = self.attention_cls(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        # TorchTitan's depth-scaled init of the output projections.
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class Llama3(nn.Module):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``. Other decoder families
    subclass it with their own block (``block_cls``) and RoPE table (``precompute_rope``)."""

    block_cls: type[TransformerBlock] = TransformerBlock

    def __init__(self, args: Llama3Args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed "0", "1", ... keeps TorchTitan's ``layers.{i}`` names.
        self.layers = nn.ModuleDict({str(i): self.block_cls(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # The RoPE table: recomputed at build, never checkpointed.
        self.register_buffer("freqs_cis", self.precompute_rope(args), persistent=False)

    @staticmethod
    def precompute_rope(args: Llama3Args) -> torch.Tensor:
        return precompute_freqs_cis(args)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter and buffer (also after ``to_empty`` from meta)."""
        device = buffer_device or self.freqs_cis.device
        with torch.device(device):
            self.freqs_cis = self.precompute_rope(self.args)
        # Tied embeddings take the output projection's init (as in TorchTitan): a unit-normal
        # embedding used as the output would start with enormous logits.
        if not self.args.tie_word_embeddings:
            nn.init.normal_(self.tok_embeddings.weight)
        for block in self.layers.values():
            block.init_weights()
        self.norm.reset_parameters()
        cutoff = 3.0
        std = self.args.dim**-0.5
        nn.init.trunc_normal_(
            self.output.weight, mean=0.0, std=std, a=-cutoff * std, b=cutoff * std
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage keeps some of the modules (the others are None): it takes the
        # previous stage's hidden states and returns its own, or the logits on the last stage.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for block in self.layers.values():
            h = block(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_decoder(
    model_cls: type[Llama3],
    family: str,
    flavors: dict[str, Any],
    flavor: Any,
    overrides: dict[str, object],
) -> Llama3:
    """Build ``model_cls`` from a named flavor of ``flavors`` (or explicit args), with field
    overrides; initialised unless built on the meta device."""
    if isinstance(flavor, str):
        try:
            args = flavors[flavor]
        except KeyError:
            known = ", ".join(flavors)
            raise ValueError(
                f"unknown {family} flavor {flavor!r}; known flavors: {known}"
            ) from None
    else:
        args = flavor
    if overrides:
        args = replace(args, **overrides)
    model = model_cls(args)
    if not any(p.is_meta for p in model.parameters()):
        model.init_weights()
    return model


def build_llama3(flavor: str | Llama3Args, **overrides: object) -> Llama3:
    """Build a Llama 3 model of a named flavor (or explicit args), with field overrides."""
    return build_decoder(Llama3, "llama3", LLAMA3_FLAVORS, flavor, overrides)
