"""The reference model: TorchTitan's names, flavors, math; meta-device construction."""

from __future__ import annotations

import pytest
import torch

from dcpkit.models import build_model, flavors, known_models
from dcpkit.models.llama3 import LLAMA3_FLAVORS, apply_rotary_emb, precompute_freqs_cis

# (flavor, dim, layers, heads, kv heads, vocab, FFN hidden, parameters) from TorchTitan / Meta.
PUBLISHED = [
    ("debugmodel", 256, 6, 16, 16, 2048, 768, 6_163_712),
    ("1B", 2048, 16, 32, 8, 128256, 8192, 1_235_814_400),
    ("3B", 3072, 28, 24, 8, 128256, 8192, 3_212_749_824),
    ("8B", 4096, 32, 32, 8, 128256, 14336, 8_030_261_248),
    ("70B", 8192, 80, 64, 8, 128256, 28672, 70_553_706_496),
    ("405B", 16384, 126, 128, 8, 128256, 53248, 405_853_388_800),
]


@pytest.mark.parametrize(
    ("flavor", "dim", "layers", "heads", "kv", "vocab", "ffn", "params"), PUBLISHED
)
def test_flavors_on_meta_device(flavor, dim, layers, heads, kv, vocab, ffn, params):
    with torch.device("meta"):
        model = build_model("llama3", flavor)
    args = model.args
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.vocab_size) == (
        dim,
        layers,
        heads,
        kv,
        vocab,
    )
    assert args.ffn_hidden_dim == ffn
    assert args.rope_theta == 500000 and args.norm_eps == 1e-5
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == params


def test_parameter_names_are_torchtitans():
    model = build_model("llama3", "debugmodel", max_seq_len=32)
    names = list(model.state_dict())
    expected = ["tok_embeddings.weight"]
    for i in range(6):
        expected += [f"layers.{i}.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo")]
        expected += [f"layers.{i}.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")]
        expected += [f"layers.{i}.attention_norm.weight", f"layers.{i}.ffn_norm.weight"]
    expected += ["norm.weight", "output.weight"]
    assert names == expected
    assert "freqs_cis" not in names  # a buffer recomputed at build, never checkpointed


def test_forward_shapes_and_causality():
    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", max_seq_len=32)
    tokens = torch.randint(0, 2048, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 2048)
    # Changing a later token leaves earlier positions' logits unchanged.
    other = tokens.clone()
    other[:, 10] = (other[:, 10] + 1) % 2048
    assert torch.equal(model(other)[:, :10], logits[:, :10])
    assert not torch.equal(model(other)[:, 10:], logits[:, 10:])


def test_rope_is_interleaved_complex_rotation():
    args = LLAMA3_FLAVORS["debugmodel"]
    freqs = precompute_freqs_cis(args, 8)
    assert freqs.shape == (8, args.head_dim // 2) and freqs.dtype == torch.complex64
    x = torch.randn(1, 8, 2, args.head_dim)
    q, _ = apply_rotary_emb(x, x, freqs)
    # Position 0 is not rotated; rotation keeps the norm of each (even, odd) pair.
    assert torch.allclose(q[:, 0], x[:, 0])
    pairs_in = x.view(1, 8, 2, -1, 2).norm(dim=-1)
    pairs_out = q.view(1, 8, 2, -1, 2).norm(dim=-1)
    assert torch.allclose(pairs_in, pairs_out, atol=1e-5)


def test_llama31_frequency_scaling():
    from dataclasses import replace

    args = LLAMA3_FLAVORS["8B"]
    scaled = precompute_freqs_cis(args, 2).angle()[1]
    plain = precompute_freqs_cis(replace(args, rope_scaling=False), 2).angle()[1]
    # High frequencies are untouched, the lowest are divided by the factor 8.
    assert torch.isclose(scaled[0], plain[0])
    assert torch.isclose(scaled[-1], plain[-1] / 8, rtol=1e-4)


def test_tied_flavor_shares_embedding():
    model = build_model("llama3", "debugmodel", max_seq_len=8, tie_word_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight


def test_unknown_names_list_known_ones():
    assert known_models() == ["deepseek_v3", "llama3", "qwen3", "qwen3_moe"]
    assert "8B" in flavors("llama3") and "0.6B" in flavors("qwen3")
    with pytest.raises(ValueError, match="known models: deepseek_v3, llama3, qwen3, qwen3_moe"):
        build_model("gpt9", "x")
    with pytest.raises(ValueError, match="known flavors: debugmodel, 200M, 1B"):
        build_model("llama3", "7B")
    with pytest.raises(ValueError, match=r"known flavors: debugmodel, 0\.6B"):
        build_model("qwen3", "7B")


@pytest.mark.parametrize("flavor", ["debugmodel", "0.6B", "1.7B", "4B", "8B", "14B", "32B"])
def test_qwen3_flavors_match_transformers(flavor):
    """Every Qwen 3 flavor has exactly the parameters of transformers' own Qwen3ForCausalLM
    built from the config.json that to-hf writes for it (both on meta)."""
    import transformers

    from dcpkit.convert.adapters import get_adapter

    with torch.device("meta"):
        ours = build_model("qwen3", flavor)
        config = get_adapter("qwen3").hf_config(ours.args, torch.bfloat16, None, None)
        config_cls = transformers.AutoConfig.for_model("qwen3").__class__
        hf = transformers.Qwen3ForCausalLM(
            config_cls(**{k: v for k, v in config.items() if k != "architectures"})
        )
    assert all(p.is_meta for p in ours.parameters())
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in hf.parameters())
    assert (ours.output.weight is ours.tok_embeddings.weight) == ours.args.tie_word_embeddings


def test_qwen3_names_and_rotate_half_rope():
    from dcpkit.models.qwen3 import apply_rotary_emb, precompute_rope_cache

    model = build_model("qwen3", "debugmodel", max_seq_len=32, n_layers=1)
    assert [k for k in model.state_dict() if k.startswith("layers.0.attention.")] == [
        f"layers.0.attention.{w}.weight" for w in ("wq", "wk", "wv", "wo", "q_norm", "k_norm")
    ]
    # Position p rotates the pair (i, i + head_dim/2) by p * theta^(-2i/head_dim).
    args = model.args
    cache = precompute_rope_cache(args, 8)
    x = torch.zeros(1, 8, 1, args.head_dim)
    x[..., 1] = 1.0
    rotated, _ = apply_rotary_emb(x, x, cache)
    angle = 5 * args.rope_theta ** (-2 / args.head_dim)
    half = args.head_dim // 2
    assert torch.allclose(rotated[0, 5, 0, 1], torch.tensor(angle).cos())
    assert torch.allclose(rotated[0, 5, 0, 1 + half], torch.tensor(angle).sin())
    assert rotated[0, 5, 0].count_nonzero() == 2
