"""Under torchrun (2 ranks): write the small checkpoint kept in ``tests/data/v0.1/`` and what a
load of it must restore. Kept to show how the committed files were made (by dcpkit 0.1.0, the
format before any change to it); the test reads the committed files, it never reruns this.

    torchrun --standalone --nproc-per-node 2 tests/scripts/write_v01_checkpoint.py OUT_DIR
"""

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as torch_dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointManager, dist
from dcpkit.models import build_model

TINY = {"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128}


class Position:
    """A per-run data position (global state: every rank holds the same)."""

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


def build():
    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", max_seq_len=16, **TINY)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def main() -> None:
    out = Path(sys.argv[1])
    torch_dist.init_process_group("gloo")
    rank = dist.rank()
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    model, opt, sched = build()
    torch.manual_seed(300 + rank)
    data, train_state = Position(), TrainState()
    config = CheckpointConfig(enable=True, folder=str(out / "checkpoint"), interval=2)
    mgr = CheckpointManager(
        config, out, model, opt, sched, dataloader=data, states={"train_state": train_state}
    )
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    for step in (1, 2, 3):
        loss = torch.nn.functional.cross_entropy(
            model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        data.consumed += 2
        train_state.step = step
        mgr.save(step, last_step=step == 3)
        if step == 2:
            # What a load of step 2 must restore: full model and optimizer, other state, and on
            # every rank the next draws of each generator.
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            tensors = {
                f"model/{k}": v for k, v in get_model_state_dict(model, options=full).items()
            }
            flat_opt = StateDictOptions(
                full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
            )
            for k, v in get_optimizer_state_dict(model, opt, options=flat_opt).items():
                if torch.is_tensor(v):
                    tensors[f"optimizer/{k}"] = v.reshape(v.shape)
            state = random.getstate(), np.random.get_state(), torch.get_rng_state()
            draws = {
                "python": random.random(),
                "numpy": float(np.random.rand()),
                "torch": torch.rand(4).tolist(),
            }
            random.setstate(state[0])
            np.random.set_state(state[1])
            torch.set_rng_state(state[2])
            all_draws = dist.all_gather_object(draws)
            if rank == 0:
                save_file(
                    {k: v.contiguous() for k, v in tensors.items()}, out / "expected.safetensors"
                )
                expected = {
                    "step": 2,
                    "lr_scheduler": sched.state_dict()["last_epoch"],
                    "lr": sched.get_last_lr(),
                    "dataloader": data.consumed,
                    "train_state": train_state.state_dict(),
                    "rng_draws_by_rank": all_draws,
                    "model_config": TINY,
                }
                (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    mgr.close()
    torch_dist.barrier()  # no rank leaves while another is still in the group
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
