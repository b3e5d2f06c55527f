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
    proc = cli("from-hf", str(out), str(tmp_path / "back"), "--model", "hf", "--verify")
    assert proc.returncode == 0, proc.stderr
    proc = cli("diff", str(tmp_path / "back"), str(out), "--model", "hf")
    assert proc.returncode == 0 and " 0 differ;" in proc.stdout
