"""A model of one's own: a ``transformers`` model of a shape that is no named flavor, saved with
``save_pretrained``, imported with ``dcpkit from-hf`` and exported again with ``dcpkit to-hf``
from the command line without ``--model`` or ``--flavor``: every tensor bitwise in its dtype,
and the ``config.json`` the user brought, field by field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import cli, hf_tensors
from dcpkit.convert.adapters import get_adapter

CASES = {
    "llama3-untied-gqa": ("llama3", dict(hidden_size=96, num_attention_heads=4, head_dim=24,
                          num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=False)),
    "llama3-tied": ("llama3", dict(hidden_size=96, num_attention_heads=4, head_dim=24,
                    num_key_value_heads=4, intermediate_size=192, tie_word_embeddings=True)),
    "llama3-rope-3.1": ("llama3", dict(hidden_size=64, num_attention_heads=2, head_dim=32,
                        num_key_value_heads=1, intermediate_size=160)),
    "qwen3-tied": ("qwen3", dict(hidden_size=96, head_dim=16, tie_word_embeddings=True)),
    "qwen3-untied": ("qwen3", dict(hidden_size=96, head_dim=16, tie_word_embeddings=False)),
    "qwen3_moe": ("qwen3_moe", {}),
    "deepseek_v3": ("deepseek_v3", {}),
}  # fmt: skip


def _save_pretrained(family: str, changes: dict, folder: Path, name: str) -> dict:
    import transformers

    adapter = get_adapter(family)
    config = adapter.hf_config(adapter.resolve_flavor("debugmodel"), torch.bfloat16, 1, 2)
    config.update(changes, vocab_size=320, num_hidden_layers=2)  # no named flavor
    if name == "llama3-rope-3.1":
        assert config["rope_scaling"]["rope_type"] == "llama3"  # Llama 3.1's scaling, kept
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    with torch.no_grad():  # norms initialised to ones would hide a swapped or missing norm
        for key, param in model.named_parameters():
            if "norm" in key:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder), max_shard_size="2MB")
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_what_from_hf_imports_to_hf_exports_from_the_command_line(name, tmp_path):
    family, changes = CASES[name]
    original = _save_pretrained(family, changes, tmp_path / "mine", name)
    proc = cli("from-hf", str(tmp_path / "mine"), str(tmp_path / "dcp"))
    assert proc.returncode == 0, proc.stderr
    assert f"model family {family}: config.json's model_type" in proc.stdout
    assert "flavor: custom" in proc.stdout
    proc = cli("to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "from the checkpoint's manifest" in proc.stdout
    before, after = hf_tensors(tmp_path / "mine"), hf_tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        assert after[key].dtype == tensor.dtype and torch.equal(after[key], tensor), key
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported == original  # field by field: nothing dropped, nothing changed


def test_to_hf_with_model_hf_refuses_torchtitan_names(stopped_run, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "vocab_size": 2048}))
    ckpt = stopped_run / "checkpoint" / "step-10"
    proc = cli("to-hf", str(ckpt), str(tmp_path / "out"), "--model", "hf", "--config", str(config))
    assert proc.returncode != 0
    assert "holds TorchTitan's parameter names (layers.0." in proc.stderr
    assert "--model llama3" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [("gpt2", "use --model hf"), ("qwen3", "use --model qwen3")],
)
def test_a_family_mismatch_names_the_model_to_use(tmp_path, model_type, expected):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    proc = cli("from-hf", str(folder), str(tmp_path / "dcp"), "--model", "llama3")
    assert proc.returncode != 0 and expected in proc.stderr, proc.stderr


def test_to_hf_honours_config_for_every_family(stopped_run, tmp_path):
    adapter = get_adapter("llama3")
    config = adapter.hf_config(adapter.resolve_flavor("debugmodel"), torch.float32, None, None)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    ckpt = str(stopped_run / "checkpoint" / "step-10")
    proc = cli("to-hf", ckpt, str(tmp_path / "out"), "--model", "llama3", "--config", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "flavor: debugmodel" in proc.stdout  # the args read from the config given
    wrong = dict(config, num_attention_heads=8)  # shapes that do not fit the checkpoint
    path.write_text(json.dumps(wrong))
    proc = cli("to-hf", ckpt, str(tmp_path / "bad"), "--model", "llama3", "--config", str(path))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    both = ("--flavor", "debugmodel", "--config", str(path))
    proc = cli("to-hf", ckpt, str(tmp_path / "both"), *both)
    assert proc.returncode != 0 and "--flavor or --config" in proc.stderr


_SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
TRAINED = {  # what the Trainer trains, each under the name its config.json gives its fields
    "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32),
    "qwen2": _SMALL,
    "mistral": _SMALL,
    "gemma": {**_SMALL, "head_dim": 8},
    "phi3": {**_SMALL, "pad_token_id": 0},
}


@pytest.mark.parametrize("model_type", sorted(TRAINED))
def test_a_transformers_model_saved_with_its_config_exports_with_no_arguments(model_type, tmp_path):
    """A ``transformers`` causal LM saved by a manager that records its config (as the Trainer
    integration does): ``dcpkit to-hf STEP OUT`` with no flavor or config loads in
    ``from_pretrained`` with the same logits (GPT-2 names its layers ``n_layer``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dcpkit import CheckpointConfig, CheckpointManager
    from dcpkit.convert.hf_model import HFModel

    torch.manual_seed(0)
    hf_config = AutoConfig.for_model(model_type, **TRAINED[model_type])
    model = AutoModelForCausalLM.from_config(hf_config)
    config = CheckpointConfig(enable=True, folder=str(tmp_path / "checkpoint"), interval=1)
    with CheckpointManager(config, tmp_path, model, hf_model=HFModel("hf", model.config)) as mgr:
        mgr.save(1)
    proc = cli("to-hf", str(tmp_path / "checkpoint" / "step-1"), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    # --model hf alone: the config is the manifest's, not asked for again
    named = cli("to-hf", str(tmp_path / "checkpoint" / "step-1"), str(tmp_path / "named"),
                "--model", "hf")  # fmt: skip
    assert named.returncode == 0 and "from the checkpoint's manifest" in named.stdout, named
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model.eval()(tokens).logits - back.eval()(tokens).logits).abs().max().item()
    assert diff <= 1e-5, diff
