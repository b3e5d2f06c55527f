"""A transformers model trained under FSDP2 with CheckpointManager exports with its own names:
``to-hf --model hf``, ``from_pretrained`` gives the trained model's logits, ``diff`` finds the
checkpoint and its export identical, and ``from-hf --model hf`` imports it back."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import cli, run_script


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_transformers_model_under_fsdp_exports_with_its_names(kind, tmp_path):
    from transformers import AutoModelForCausalLM

    run_script(2, "hf_named_fsdp.py", str(tmp_path), kind)
    ckpt, out = tmp_path / "checkpoint" / "step-4", tmp_path / "export"
    # Under a TorchTitan family, the names say what it is and how to export it.
    proc = cli("to-hf", str(ckpt), str(tmp_path / "wrong"), "--flavor", "debugmodel")
    assert proc.returncode == 2 and "--model hf --config CONFIG_JSON" in proc.stderr
    config = str(tmp_path / "config.json")
    proc = cli("to-hf", str(ckpt), str(out), "--model", "hf", "--config", config, "--verify")
    assert proc.returncode == 0, proc.stderr
    assert "verified: transformers logits of the export vs the source checkpoint" in proc.stdout
    expected = load_file(tmp_path / "expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=expected["tokens"]).logits
    assert (logits - expected["logits"]).abs().max().item() <= 1e-6
    proc = cli("diff", str(ckpt), str(out), "--model", "hf")
    assert proc.returncode == 0 and " 0 differ; 0 only in A, 0 only in B" in proc.stdout, (
        proc.stdout
    )
    proc = cli("diff", str(ckpt), str(out))  # the family told by the names: no --model
    assert proc.returncode == 0 and " 0 differ; 0 only in A, 0 only in B" in proc.stdout
    assert "model family hf: its parameters carry transformers' names" in proc.stdout
    proc = cli("from-hf", str(out), str(tmp_path / "back"), "--model", "hf", "--verify")
    assert proc.returncode == 0, proc.stderr
    proc = cli("diff", str(tmp_path / "back"), str(out), "--model", "hf")
    assert proc.returncode == 0 and " 0 differ;" in proc.stdout


@pytest.mark.dist
def test_hf_model_takes_the_transformers_config_and_publishes_the_last_save_in_hf(tmp_path):
    """A user's FSDP2 loop with ``HFModel("hf", model.config)`` and ``last_save_in_hf``: the last
    step is a Hugging Face folder whose logits are the trained model's; a second manager on the
    folder in the same process is refused once the first has saved there."""
    from transformers import AutoModelForCausalLM

    proc = run_script(2, "hf_named_fsdp.py", str(tmp_path), "llama", "hf_last")
    assert "SECOND REFUSED" in proc.stdout and "another CheckpointManager of this process" in (
        proc.stdout
    )
    final = tmp_path / "checkpoint" / "step-4"
    assert (final / "config.json").is_file() and not (final / ".metadata").exists()
    assert cli("verify", str(final)).returncode == 0
    expected = load_file(tmp_path / "expected.safetensors")
    model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=expected["tokens"]).logits
    assert (logits - expected["logits"]).abs().max().item() <= 1e-6


@pytest.mark.parametrize(
    "args,match",
    [
        ("not-a-config", "config.json is needed"),
        (42, "args must be a flavor name, a config.json"),
        ({"hidden_size": 8}, "config.json has no model_type"),
    ],
)
def test_hf_model_refuses_what_is_not_a_config(args, match):
    from dcpkit import ConfigError, HFModel

    with pytest.raises(ConfigError, match=match):
        HFModel("hf", args)


def test_hf_model_reads_every_spelling_of_the_config(tmp_path):
    from transformers import LlamaConfig

    from dcpkit import ConfigError, HFModel
    from dcpkit.models import flavors

    config = LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config.to_json_file(str(tmp_path / "config.json"))
    spellings = [config, config.to_dict(), str(tmp_path / "config.json"), tmp_path]
    read = [HFModel("hf", s).args.config["hidden_size"] for s in spellings]
    assert read == [32, 32, 32, 32]
    assert HFModel("llama3", "debugmodel").args == flavors("llama3")["debugmodel"]
    assert HFModel("llama3", config).args.dim == 32  # a family's args from a transformers config
    with pytest.raises(ConfigError, match=r"model_type 'llama', not 'qwen3'.*--model llama3"):
        HFModel("qwen3", config)
    with pytest.raises(ConfigError, match="unknown model family 'gpt'; known families"):
        HFModel("gpt", config)
