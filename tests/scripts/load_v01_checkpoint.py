"""Under torchrun (any world size): load the committed v0.1 checkpoint through the public API
and check every restored piece against what the writer recorded (``expected.*``)."""

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointManager, dist
from dcpkit.models import build_model


class Position:
    def __init__(self) -> None:
        self.consumed = 0

    def state_dict(self):
        return {"consumed": self.consumed, "order": torch.arange(6)}

    def load_state_dict(self, state):
        self.consumed = int(state["consumed"])


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.step * 64}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def main() -> None:
    root = Path(sys.argv[1])
    expected = json.loads((root / "expected.json").read_text())
    tensors = load_file(root / "expected.safetensors")
    torch_dist.init_process_group("gloo")
    rank = dist.rank()
    torch.manual_seed(1)  # another init than the writer's: every value must come from the file
    model = build_model("llama3", "debugmodel", max_seq_len=16, **expected["model_config"])
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    data, train_state = Position(), TrainState()
    config = CheckpointConfig(enable=True, folder=str(root / "checkpoint"), load_step=2)
    mgr = CheckpointManager(
        config, root, model, opt, sched, dataloader=data, states={"train_state": train_state}
    )
    assert mgr.load() == 2
    draws = {
        "python": random.random(),
        "numpy": float(np.random.rand()),
        "torch": torch.rand(4).tolist(),
    }
    saved_world = len(expected["rng_draws_by_rank"])
    assert rank >= saved_world or draws == expected["rng_draws_by_rank"][rank], (rank, draws)
    # Full (unsharded) state, gathered on rank 0 (cpu_offload leaves the other ranks empty).
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=full)
    flat = StateDictOptions(
        full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
    )
    opt_sd = get_optimizer_state_dict(model, opt, options=flat)
    if rank == 0:
        got = {f"model/{k}": v for k, v in model_sd.items()}
        got.update({f"optimizer/{k}": v for k, v in opt_sd.items() if torch.is_tensor(v)})
        assert sorted(got) == sorted(tensors), sorted(set(got) ^ set(tensors))
        for k, v in got.items():
            assert torch.equal(v, tensors[k]), k
    assert sched.last_epoch == expected["lr_scheduler"] and sched.get_last_lr() == expected["lr"]
    assert data.consumed == expected["dataloader"]
    assert train_state.state_dict() == expected["train_state"]
    mgr.close()
    # The latest step is the model-only last save.
    latest = CheckpointManager(
        CheckpointConfig(enable=True, folder=str(root / "checkpoint"), load_only=True), root, model
    )
    assert latest.load() == 3
    if rank == 0:
        print(f"v0.1 checkpoint restored at world size {dist.world_size()}: OK")
    torch_dist.barrier()  # no rank leaves while another is still in the group
    torch_dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter finalization, where gloo's threads can abort


if __name__ == "__main__":
    main()
