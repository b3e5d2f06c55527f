"""Under torchrun: a user's loop (FSDP2 model + AdamW, a sampler whose state holds 0-dim
tensors, a per-rank reader position) saving through CheckpointManager, stopped and restarted.

    restart_plans.py FOLDER first MODE     # trains and saves steps 1 and 2
    restart_plans.py FOLDER restart MODE   # resumes step 2, saves 3 (and 4: rank 1's per-rank
                                           # state gains a key there, only on rank 1)
    restart_plans.py FOLDER check MODE STEP  # dcp.load of STEP into a fresh state

MODE is the async_mode. Rank 0 prints ``RESULT {json}``: the global plannings this process ran
after each save, and (check) whether DCP's own load of the checkpoint equals the state saved.
"""

import logging
import os
import sys

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import fully_shard
from user_states import Reader, Sampler, report, snapshot, train_step

from dcpkit import CheckpointConfig, CheckpointManager, dist


class WithEmpty(torch.nn.Sequential):
    """The same layers, a (1, 4) parameter (over 2 ranks, rank 1's shard of it is empty; in the
    loss, so that AdamW keeps state for it) and a (0, 4) buffer (an empty tensor)."""

    def __init__(self, *layers: torch.nn.Module) -> None:
        super().__init__(*layers)
        self.register_parameter("row", torch.nn.Parameter(torch.randn(1, 4)))
        self.register_buffer("nothing", torch.zeros(0, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.row


def build(seed: int):
    torch.manual_seed(seed)
    layers = (torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = WithEmpty(*layers) if os.environ.get("EMPTY_SHARDS") else torch.nn.Sequential(*layers)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def main() -> None:
    folder, phase, mode = sys.argv[1:4]
    load_step = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    logging.basicConfig(level=logging.INFO)  # dcpkit's log lines, as a user would see them
    torch_dist.init_process_group("gloo")
    model, opt = build(0)
    sampler, reader = Sampler(), Reader()
    cfg = CheckpointConfig(
        enable=True, folder=folder, interval=1, keep_latest_k=0, async_mode=mode,
        load_step=load_step,
    )  # fmt: skip
    mgr = CheckpointManager(
        cfg, ".", model, optimizer=opt, states={"sampler": sampler},
        per_rank_states={"reader": reader},
    )  # fmt: skip
    result: dict = {"plans": []}
    if phase == "check":
        step = mgr.load()
        saved = snapshot(model, opt, sampler)
        fresh, fresh_opt = build(7)  # other values, the same shapes
        fresh_sampler, fresh_reader = Sampler(), Reader()
        other = CheckpointManager(
            CheckpointConfig(enable=False), ".", fresh, optimizer=fresh_opt,
            states={"sampler": fresh_sampler}, per_rank_states={"reader": fresh_reader},
        )  # fmt: skip
        train_step(fresh, fresh_opt, fresh_sampler, fresh_reader, 1)  # optimizer state exists
        template = other.collect()
        dcp.load(template, checkpoint_id=mgr.step_path(step))  # DCP's own reader and planner
        other.model.load_state_dict({k: template[k] for k in other.model.state_dict()})
        other.states["optimizer"].load_state_dict(template["optimizer"])
        fresh_sampler.load_state_dict(template["sampler"])
        same = all(
            torch.equal(a, b) for a, b in zip(saved, snapshot(fresh, fresh_opt, fresh_sampler))
        )
        mine = template["reader"][f"rank_{dist.rank()}"] if "reader" in template else None
        md = dcp.FileSystemReader(mgr.step_path(step)).read_metadata()
        stored = sorted(k for k in md.state_dict_metadata if k.startswith("reader."))
        result.update(step=step, bitwise=same, reader=mine, stored_reader=stored)
    else:
        start = 1
        if phase == "restart":
            start = mgr.load() + 1
        for step in (start, start + 1):
            train_step(model, opt, sampler, reader, step)
            if phase == "restart" and step == start + 1 and dist.rank() == 1:
                reader.extra = 5  # rank 1's plan alone changes
            mgr.save(step)
            mgr.maybe_wait_for_staging()
            mgr.wait()
            result["plans"].append(mgr.global_plans)
    mgr.close()
    report(result)


if __name__ == "__main__":
    main()
