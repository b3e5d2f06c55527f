"""Mixture-of-experts families: shapes against transformers' own models, logits, the
transformers round trip, FP8 import, and the key-map errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from dcpkit.convert.adapters import ConversionError, get_adapter
from dcpkit.convert.fp8 import Dequantized, dequantize
from dcpkit.convert.hf import from_hf, to_hf
from dcpkit.formats.dcp import DCPCheckpoint
from dcpkit.formats.safetensors import SafetensorsFolder
from dcpkit.models import build_model, flavors

transformers = pytest.importorskip("transformers")

FAMILIES = ("qwen3_moe", "deepseek_v3")


def _hf_model(family: str, args, dtype=torch.float32):
    config = get_adapter(family).hf_config(args, dtype, None, None)
    hf_config = transformers.AutoConfig.for_model(**config)
    return transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype), config


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_counts_equal_transformers_for_every_flavor(family):
    for name, args in flavors(family).items():
        with torch.device("meta"):
            ours = build_model(family, args)
            theirs, _ = _hf_model(family, args)
        n_ours = sum(p.numel() for p in ours.parameters())
        n_theirs = sum(p.numel() for p in theirs.parameters())
        assert n_ours == n_theirs, (family, name, n_ours, n_theirs)
        expected = get_adapter(family).expected_shapes(args)
        assert sum(math.prod(s) for k, s in expected.items() if "expert_bias" not in k) == n_ours


def _write_dcp(model, path, perturb_bias=True):
    state = dict(model.state_dict())
    for key, t in state.items():
        if perturb_bias and key.endswith("expert_bias"):
            t.normal_(0, 0.01, generator=torch.Generator().manual_seed(1))
    dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    return state


@pytest.mark.parametrize("family", FAMILIES)
def test_to_hf_logits_match_transformers_and_come_back_bitwise(tmp_path, family):
    torch.manual_seed(0)
    model = build_model(family, "debugmodel")
    state = _write_dcp(model, tmp_path / "ck")
    result = to_hf(tmp_path / "ck", tmp_path / "hf", family, "debugmodel", verify=True)
    assert result.max_logits_diff is not None and result.max_logits_diff <= 1e-5
    # One HF tensor per expert, stacked back on import.
    stacked = next(k for k in state if k.endswith("moe.experts.w1"))
    layer = stacked.split(".")[1]
    keys = SafetensorsFolder(tmp_path / "hf").names()
    experts = model.args.moe.num_experts
    for e in range(experts):
        assert f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight" in keys
    back = from_hf(tmp_path / "hf", tmp_path / "back", family, verify=True)
    assert back.flavor == "debugmodel"
    with DCPCheckpoint(tmp_path / "back") as ck:
        assert sorted(ck.tensors) == sorted(state)
        for key, t in state.items():
            assert torch.equal(ck.read(key), t), key


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_folder_goes_from_hf_to_hf_bitwise(tmp_path, family):
    torch.manual_seed(0)
    args = flavors(family)["debugmodel"]
    hf, _ = _hf_model(family, args)
    if family == "deepseek_v3":  # a trained bias, so that losing it would show
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "e_score_correction_bias"):
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.01)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="4MB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    from_hf(tmp_path / "hf", tmp_path / "dcp", family)
    to_hf(tmp_path / "dcp", tmp_path / "again", family, "debugmodel")
    original = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        original.update(load_file(f))
    again = {}
    for f in (tmp_path / "again").glob("*.safetensors"):
        again.update(load_file(f))
    assert sorted(again) == sorted(original)
    for key, t in original.items():
        assert again[key].dtype == t.dtype and torch.equal(again[key], t), key


def _fp8_weight(shape, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(shape, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand((math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)), generator=g) + 0.5
    return q, scale


def _reference_dequant(q, scale):
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = block * scale[i, j]
    return out


def test_fp8_block_scaled_weights_dequantize_to_the_reference_values(tmp_path):
    q, scale = _fp8_weight((300, 200), 0)  # partial blocks on both edges
    save_file({"w.weight": q, "w.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    ref = _reference_dequant(q, scale)
    assert torch.equal(dequantize(q, scale, (128, 128)), ref)
    folder = Dequantized(SafetensorsFolder(tmp_path), torch.float32, (128, 128), "t")
    assert folder.names() == ["w.weight"]
    assert torch.equal(folder.read("w.weight"), ref)
    for rows in ((0, 1), (5, 140), (127, 129), (256, 300)):  # row blocks across block edges
        assert torch.equal(folder.read("w.weight", rows), ref[rows[0] : rows[1]])
    bf16 = Dequantized(SafetensorsFolder(tmp_path), torch.bfloat16, (128, 128), "t")
    assert torch.equal(bf16.read("w.weight"), ref.to(torch.bfloat16))


def test_from_hf_dequantizes_a_deepseek_fp8_folder(tmp_path):
    """A DeepSeek-V3-shaped folder whose linear weights are FP8 with block scales (as published)
    imports with every weight equal to the reference dequantization."""
    torch.manual_seed(0)
    args = flavors("deepseek_v3")["debugmodel"]
    hf, config = _hf_model("deepseek_v3", args)
    hf.save_pretrained(tmp_path / "src")
    tensors = {}
    for f in (tmp_path / "src").glob("*.safetensors"):
        tensors.update(load_file(f))
    quantized, expected = {}, {}
    for i, (key, t) in enumerate(sorted(tensors.items())):
        is_linear = t.dim() == 2 and key.endswith("proj.weight")
        if is_linear:
            q, scale = _fp8_weight(tuple(t.shape), i)
            quantized[key], quantized[key + "_scale_inv"] = q, scale
            expected[key] = _reference_dequant(q, scale).to(torch.bfloat16)
        else:
            quantized[key] = t
            expected[key] = t
    (tmp_path / "fp8").mkdir()
    save_file(quantized, str(tmp_path / "fp8" / "model.safetensors"))
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    from_hf(tmp_path / "fp8", tmp_path / "dcp", "deepseek_v3", budget=1 << 20)
    to_hf(tmp_path / "dcp", tmp_path / "out", "deepseek_v3", "debugmodel")
    out = {}
    for f in (tmp_path / "out").glob("*.safetensors"):
        out.update(load_file(f))
    assert sorted(out) == sorted(expected)
    for key, t in expected.items():
        assert torch.equal(out[key], t), key


def test_torchtitan_expert_spellings_and_missing_experts(tmp_path):
    torch.manual_seed(0)
    model = build_model("qwen3_moe", "debugmodel")
    state = {
        k.replace("experts.w1", "experts.w1_EFD")
        .replace("experts.w2", "experts.w2_EDF")
        .replace("experts.w3", "experts.w3_EFD")
        .replace("output.weight", "lm_head.weight"): v
        for k, v in model.state_dict().items()
    }
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    to_hf(tmp_path / "ck", tmp_path / "hf", "qwen3_moe", "debugmodel")
    (shard,) = (tmp_path / "hf").glob("*.safetensors")
    tensors = load_file(str(shard))
    assert torch.equal(
        tensors["model.layers.2.mlp.experts.5.down_proj.weight"],
        model.state_dict()["layers.2.moe.experts.w2"][5],
    )
    # An HF folder missing one expert: an error that names it, not a silent zero.
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(shard))
    with pytest.raises(ConversionError, match=r"expert\(s\) 3 of layers\.1\.moe\.experts\.w3"):
        from_hf(tmp_path / "hf", tmp_path / "back", "qwen3_moe")
    assert not (tmp_path / "back").exists()


def test_transformers_default_deepseek_v3_config_is_the_671b_flavor():
    """transformers' DeepseekV3Config defaults are the published 671B model."""
    adapter = get_adapter("deepseek_v3")
    args = adapter.args_from_hf_config(transformers.DeepseekV3Config().to_dict())
    assert adapter.expected_shapes(args) == adapter.expected_shapes(flavors("deepseek_v3")["671B"])
    total = sum(math.prod(s) for k, s in adapter.expected_shapes(args).items() if "bias" not in k)
    assert round(total / 1e9) == 671
