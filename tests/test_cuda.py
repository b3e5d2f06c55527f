"""The CUDA path of saves: side-stream copies into page-locked buffers, and exact resume.

These run where a CUDA device is present (``benchmarks/device_check.sh`` runs them with the GPU
stall benchmark); elsewhere they are skipped.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import read_metrics, run_train
from dcpkit import CheckpointConfig, CheckpointManager
from dcpkit.models import build_model
from dcpkit.storage import open_store

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODES = ["disabled", "async", "async_with_pinned_mem"]


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model("llama3", "debugmodel", max_seq_len=16, dim=512, n_layers=4)
    model.to_empty(device=device)
    model.init_weights()
    return model


@pytest.mark.parametrize("mode", MODES)
def test_saved_state_is_the_state_at_save_time(mode, tmp_path, process_group):
    model = _model("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    cfg = CheckpointConfig(enable=True, interval=1, keep_latest_k=2, async_mode=mode)
    mgr = CheckpointManager(cfg, tmp_path, model, optimizer=opt)
    pointers = []
    for step in range(1, 4):
        mgr.save(step)
        mgr.maybe_wait_for_staging()
        snapshot = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        # Changes the weights on the current stream right after staging: a copy still running
        # would save some of the new values.
        opt.step()
        if mgr._async is not None:
            pointers.append({k: b.data_ptr() for k, b in mgr._async.buffers.items()})
            pinned = [b.is_pinned() for b in mgr._async.buffers.values()]
            assert all(pinned) == (mode == "async_with_pinned_mem"), pinned
            mgr._async.wait()
    mgr.close()
    if pointers:
        assert all(p == pointers[0] for p in pointers)  # allocated once, reused
    assert open_store(tmp_path / "checkpoint").published_steps() == [2, 3]
    fresh = _model("cpu")
    CheckpointManager(CheckpointConfig(enable=True), tmp_path, fresh).load()
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, snapshot[key]), key


def test_resume_from_pinned_async_checkpoint_is_bitwise(tmp_path):
    ref = tmp_path / "sync"
    run_train(1, ref)
    dump = tmp_path / "pinned"
    mode = ("--checkpoint.async_mode", "async_with_pinned_mem")
    run_train(1, dump, *mode, "--training.stop_at_step", "12")
    assert open_store(dump / "checkpoint").published_steps() == [5, 10, 12]
    shutil.rmtree(dump / "checkpoint" / "step-12")  # resume from the background-written step
    proc = run_train(1, dump, *mode)
    assert "step-10" in proc.stdout
    want, got = read_metrics(ref), read_metrics(dump)
    for step in range(1, 21):
        assert got[step]["loss"] == want[step]["loss"], f"step {step}"
    assert got[15]["checkpoint_saved"] and got[15]["checkpoint_stall_s"] > 0
