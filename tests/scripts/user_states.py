"""What the torchrun test scripts share: a user's sampler (0-dim tensors) and per-rank reader,
a training step with the same batch on every rank, a snapshot of the state it changes, and the
way a script reports and leaves its process group."""

import json

import torch
import torch.distributed as torch_dist
from torch.distributed.tensor import DTensor

from dcpkit import dist


class Sampler:
    def __init__(self) -> None:
        self.epoch, self.seen = torch.tensor(0), torch.tensor(0.0)

    def state_dict(self):
        return {"epoch": self.epoch, "seen": self.seen}

    def load_state_dict(self, state):
        self.epoch, self.seen = state["epoch"].clone(), state["seen"].clone()


class Reader:
    """A per-rank position; ``extra`` appears in its state once set (a layout change)."""

    def __init__(self) -> None:
        self.position, self.extra = 0, None

    def state_dict(self):
        out = {"position": self.position}
        if self.extra is not None:
            out["extra"] = self.extra
        return out

    def load_state_dict(self, state):
        self.position, self.extra = int(state["position"]), state.get("extra")

    def reshard_state_dict(self, saved, rank, world_size):
        return saved[rank]


def train_step(model, opt, sampler, reader, step: int) -> None:
    torch.manual_seed(step)  # the same batch on every rank
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sampler.epoch += 1
    sampler.seen += 4.0
    reader.position = 100 * dist.rank() + step


def _local(t):
    return t.to_local().clone() if isinstance(t, DTensor) else t.clone()


def snapshot(model, opt, sampler) -> list[torch.Tensor]:
    out = [_local(p) for p in model.parameters()]
    for st in opt.state.values():
        out += [_local(v) for v in st.values()]
    return [*out, sampler.epoch.clone(), sampler.seen.clone()]


def report(result) -> None:
    """Rank 0 prints ``RESULT {json}`` of every rank's ``result``; then every rank leaves the
    group together (a barrier first: no rank leaves while another is still in it)."""
    everything = dist.all_gather_object(result)
    if dist.rank() == 0:
        print("RESULT " + json.dumps(everything), flush=True)
    torch_dist.barrier()
    dist.settle()  # the caller's model still refers to the group (see dcpkit.dist.settle)
    torch_dist.destroy_process_group()
