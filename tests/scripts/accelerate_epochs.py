"""A user's own Accelerate loop over several epochs, with gradient accumulation, a state that
differs by process and an object given to ``register_for_checkpointing``.

    torchrun --nproc-per-node 2 accelerate_epochs.py FOLDER [STOP_AFTER]

6 batches per process per epoch, 2 micro-batches per optimizer step, 22 micro-batches in all
(into a 4th epoch), a save every 2 (each optimizer step). Resumes from FOLDER's latest step.
PLAIN=1 runs the same loop without dcpkit (no saves, no resume).
Prints, on every process, ``rank R step N loss X mine M shared S epoch E`` after each
micro-batch.
"""

import os
import sys

import torch
import torch.distributed as torch_dist
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from dcpkit import CheckpointConfig
from dcpkit.integrations.accelerate import AcceleratorCheckpoint


class Counter:
    def __init__(self, start: int) -> None:
        self.n = start

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


folder = sys.argv[1]
stop_after = int(sys.argv[2]) if len(sys.argv) > 2 else 22
data_config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
accelerator = Accelerator(
    cpu=True, dataloader_config=data_config, gradient_accumulation_steps=2
)  # fmt: skip
rank = accelerator.process_index
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
)  # fmt: skip
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
rows = torch.randn(48, 9, generator=torch.Generator().manual_seed(1))
data = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
mine = Counter(1000 * (rank + 1))  # differs by process
shared = Counter(0)
accelerator.register_for_checkpointing(shared)


class Plain:
    """The same loop without dcpkit (PLAIN=1): what its uninterrupted run must equal."""

    def __enter__(self) -> "Plain":
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def load_state(self) -> int:
        return 0

    def maybe_wait_for_staging(self) -> None:
        pass

    def save_state(self, step: int, last_step: bool = False) -> None:
        pass


config = CheckpointConfig(enable=True, interval=2, keep_latest_k=0, async_mode="async")
checkpointing = Plain() if os.environ.get("PLAIN") else AcceleratorCheckpoint(
    accelerator, folder, model, optimizer, scheduler, data, config=config,
    per_rank_states={"mine": mine},
)  # fmt: skip
with checkpointing as ckpt:
    step = ckpt.load_state() or 0
    epoch = data.iteration
    while step < 22 and step < stop_after:
        for batch in data:
            step += 1
            with accelerator.accumulate(model):
                out = model(batch[:, :8]).squeeze(-1)
                loss = torch.nn.functional.mse_loss(out, batch[:, 8])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    ckpt.maybe_wait_for_staging()
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            mine.n += rank + 1
            shared.n += 1
            line = f"rank {rank} step {step} loss {loss.item()!r} mine {mine.n} shared {shared.n}"
            sys.stdout.write(f"{line} epoch {data.iteration}\n")  # one write: ranks share a pipe
            sys.stdout.flush()
            ckpt.save_state(step, last_step=step == 22)
            if step == stop_after or step == 22:
                break
torch_dist.barrier()
accelerator.end_training()
