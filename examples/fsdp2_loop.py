"""A training loop of your own, sharded with FSDP2 and checkpointed by dcpkit.

    torchrun --nproc-per-node 2 examples/fsdp2_loop.py

Run it again: it resumes after its last step (or stop it with Ctrl-C and start it again: it
goes on from the last checkpoint, bitwise as if never stopped). Checkpoints go to
./outputs/fsdp2/checkpoint/step-N; try `dcpkit list outputs/fsdp2/checkpoint`.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointManager

dist.init_process_group("gloo")  # "nccl" on GPUs
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
fully_shard(model[0])
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
config = CheckpointConfig(enable=True, interval=10, async_mode="async", last_save_model_only=False)
steps = 30
with CheckpointManager(config, "outputs/fsdp2", model, opt, sched) as ckpt:
    start = ckpt.load() or 0  # the latest published step: model, optimizer, scheduler, RNG
    for step in range(start + 1, steps + 1):
        x = torch.randn(8, 16)  # the RNG is restored too: a resumed run draws the same batches
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        loss.backward()
        ckpt.maybe_wait_for_staging()  # an async save's copy finishes before the update
        opt.step()
        opt.zero_grad()
        sched.step()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        ckpt.save(step, last_step=step == steps)  # every `interval` steps, and the last
dist.barrier()  # no rank leaves while another is still in the group
dist.destroy_process_group()
