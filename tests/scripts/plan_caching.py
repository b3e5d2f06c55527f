"""Under torchrun (2 ranks): an FSDP2 model + AdamW saved 3 times by one CheckpointManager, with a
training step between saves; prints, as JSON on rank 0, the global plannings counted on each
rank after each save and whether the last checkpoint loads back bitwise.

    plan_caching.py FOLDER disabled|async|async_with_pinned_mem
"""

import sys

import torch
import torch.distributed as torch_dist
from torch.distributed.fsdp import fully_shard
from user_states import report

from dcpkit import CheckpointConfig, CheckpointManager


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.to_local().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.to_local().clone() if hasattr(v, "to_local") else v.clone() for v in st.values()]
    return out


def main() -> None:
    folder, mode = sys.argv[1], sys.argv[2]
    torch_dist.init_process_group("gloo")
    model, opt = build()
    cfg = CheckpointConfig(enable=True, folder=folder, interval=1, keep_latest_k=2, async_mode=mode)
    counts = []
    with CheckpointManager(cfg, ".", model, optimizer=opt) as mgr:
        for step in (1, 2, 3):
            train_step(model, opt, step)
            mgr.save(step)
            mgr.maybe_wait_for_staging()
            mgr.wait()
            counts.append(mgr.global_plans)
        saved = snapshot(model, opt)
    model2, opt2 = build()
    train_step(model2, opt2, 99)  # different values, the same shapes
    with CheckpointManager(cfg, ".", model2, optimizer=opt2) as mgr2:
        assert mgr2.load() == 3
    same = all(torch.equal(a, b) for a, b in zip(saved, snapshot(model2, opt2)))
    report({"counts": counts, "bitwise": same})


if __name__ == "__main__":
    main()
