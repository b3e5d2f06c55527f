"""Under torchrun: a user's own DDP training loop around CheckpointManager, with a sampler whose
state holds 0-dim tensors and the lr schedulers users use, in every async mode.

ddp_user_loop.py ROOT full     # steps 1-8, a checkpoint at step 4 written while training goes on
ddp_user_loop.py ROOT stop     # steps 1-4, the checkpoint at step 4, then the process exits
ddp_user_loop.py ROOT resume   # loads step 4, steps 5-8
With ``all`` after the phase, every scheduler runs in every mode (15 runs); without it each
scheduler runs once, the modes taken in turn, so that every scheduler and every mode is seen
(5 runs: a scheduler's state and a mode's staging are independent of each other).
Each prints one line ``RESULT {json}``: per mode and scheduler, per step, the loss, the sampler's
position and the learning rate, bit for bit (floats as their hex).
"""

import json
import math
import sys

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dcpkit import CheckpointConfig, CheckpointManager, dist

MODES = ("disabled", "async", "async_with_pinned_mem")
STOP, LAST = 4, 8


class ShuffledSampler:
    """A user's sampler: its position and seed are 0-dim tensors, as counters often are."""

    def __init__(self, size: int, rank: int, world: int) -> None:
        self.size, self.rank, self.world = size, rank, world
        self.pos, self.epoch, self.seed = torch.tensor(0), 0, torch.tensor(1234)
        self.name, self.hist = "shuffled", [1.5, 2.5]

    def next_indices(self, batch: int) -> list[int]:
        g = torch.Generator().manual_seed(int(self.seed) + self.epoch)
        order = torch.randperm(self.size, generator=g)
        start = int(self.pos) * batch * self.world + self.rank * batch
        if start + batch > self.size:
            self.epoch, self.pos = self.epoch + 1, torch.tensor(0)
            return self.next_indices(batch)
        self.pos += 1
        self.hist.append(float(self.pos))
        return order[start : start + batch].tolist()

    def state_dict(self):
        return {"pos": self.pos, "epoch": self.epoch, "seed": self.seed, "name": self.name,
                "hist": list(self.hist)}  # fmt: skip

    def load_state_dict(self, state):
        self.pos, self.epoch, self.seed = state["pos"], state["epoch"], state["seed"]
        self.name, self.hist = state["name"], list(state["hist"])


def scheduler(kind: str, opt: torch.optim.Optimizer):
    S = torch.optim.lr_scheduler
    if kind == "StepLR":
        return S.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "LambdaLR":
        warmup = 3  # the closure captures it: only the schedule's counters are saved
        return S.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.9**s)
    if kind == "OneCycleLR":
        return S.OneCycleLR(opt, max_lr=0.05, total_steps=LAST + 1)
    if kind == "SequentialLR":
        first, second = S.LinearLR(opt, 0.2, total_iters=3), S.ExponentialLR(opt, gamma=0.8)
        return S.SequentialLR(opt, [first, second], milestones=[3])
    return S.ReduceLROnPlateau(opt, factor=0.5, patience=0, threshold=10.0)


SCHEDULERS = ("StepLR", "LambdaLR", "OneCycleLR", "SequentialLR", "ReduceLROnPlateau")


def run(root: str, mode: str, kind: str, phase: str) -> dict[int, list[str]]:
    rank, world = dist.rank(), dist.world_size()
    torch.manual_seed(0)
    data = torch.randn(64, 8), torch.randn(64, 1)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = scheduler(kind, opt)
    sampler = ShuffledSampler(64, rank, world)
    torch.manual_seed(1000 + rank)  # the dropout streams differ between ranks
    folder = f"{root}/{phase if phase == 'full' else 'resumed'}/{mode}/{kind}"
    config = CheckpointConfig(enable=True, folder=folder, interval=STOP, async_mode=mode)
    out: dict[int, list[str]] = {}
    with CheckpointManager(
        config, ".", model, opt, sched, per_rank_states={"sampler": sampler}
    ) as mgr:
        first = (mgr.load() or 0) + 1
        for step in range(first, (STOP if phase == "stop" else LAST) + 1):
            idx = sampler.next_indices(4)
            loss = nn.functional.mse_loss(model(data[0][idx]), data[1][idx])
            opt.zero_grad()
            loss.backward()
            mgr.maybe_wait_for_staging()
            opt.step()
            sched.step(loss.item()) if kind == "ReduceLROnPlateau" else sched.step()
            losses = dist.all_gather_object(loss.item())
            lr = opt.param_groups[0]["lr"]
            out[step] = [*(math.nan if x is None else float(x).hex() for x in losses),
                         int(sampler.pos), float(lr).hex()]  # fmt: skip
            mgr.save(step, last_step=step == LAST)
    return out


def main() -> None:
    root, phase = sys.argv[1], sys.argv[2]
    torch_dist.init_process_group("gloo")
    if sys.argv[3:] == ["all"]:
        combos = [(m, k) for m in MODES for k in SCHEDULERS]
    else:
        combos = [(MODES[i % len(MODES)], k) for i, k in enumerate(SCHEDULERS)]
    results = {f"{m}/{k}": run(root, m, k, phase) for m, k in combos}
    if dist.rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    torch_dist.barrier()  # no rank leaves while another is still in the group
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
