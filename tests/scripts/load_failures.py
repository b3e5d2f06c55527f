"""Under torchrun (2 ranks): a load that fails on one rank only fails on every rank, with the
failing rank's reason, and no rank waits for the others.

load_failures.py FOLDER corrupt    # a byte of rank 1's file flipped; verify_on_load
load_failures.py FOLDER truncated  # rank 1's file cut short; no verification
load_failures.py FOLDER refused    # intact: rank 1's own state refuses what it reads back
"""

import os
import sys

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager, dist


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    fully_shard(net, mesh=init_device_mesh("cpu", (dist.world_size(),)))
    return net


class Position:
    """A per-rank state (a sampler's position) whose restore refuses on rank 1, as a user's
    own ``load_state_dict`` may (a dataset that changed, a check of its own)."""

    def __init__(self) -> None:
        self.at = torch.tensor(dist.rank())

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        if dist.rank() == 1:
            raise ValueError(f"position {int(state['at'])} is past this rank's shard")
        self.at = state["at"]


def main() -> None:
    folder, mode = sys.argv[1], sys.argv[2]
    torch_dist.init_process_group("gloo")
    config = CheckpointConfig(enable=True, folder=folder, interval=1, verify_on_load=True)
    if mode == "refused":
        states = {"position": Position()}
        CheckpointManager(config, ".", model(), per_rank_states=states).save(1, force=True)
        try:
            CheckpointManager(config, ".", model(), per_rank_states=states).load()
            outcome = f"LOADED rank {dist.rank()}"
        except CheckpointError as e:
            outcome = f"FAILED rank {dist.rank()}: {e}"
        sys.stdout.write(outcome + "\n")
        sys.stdout.flush()
        dist.barrier()  # both ranks reach it: neither waits in the load for the other
        dist.settle()  # models still refer to the group (dcpkit.dist.settle)
        torch_dist.destroy_process_group()
        return
    CheckpointManager(config, ".", model()).save(1, force=True)
    dist.barrier()
    rank1 = os.path.join(folder, "step-1", "__1_0.distcp")
    if dist.rank() == 0:
        with open(rank1, "rb") as f:
            data = bytearray(f.read())
        if mode == "corrupt":
            data[-2000] ^= 0xFF  # inside the last tensor's bytes
        else:
            data = data[: len(data) // 2]
        with open(rank1, "wb") as f:
            f.write(data)
    dist.barrier()
    if mode == "truncated":
        config = CheckpointConfig(enable=True, folder=folder, interval=1, verify_on_load=False)
    try:
        CheckpointManager(config, ".", model()).load()
        outcome = f"LOADED rank {dist.rank()}"
    except CheckpointError as e:
        outcome = f"FAILED rank {dist.rank()}: {e}"
    # One write per line: two processes' prints on one stdout could interleave.
    sys.stdout.write(outcome + "\n")
    sys.stdout.flush()
    dist.barrier()
    dist.settle()  # models still refer to the group (dcpkit.dist.settle)
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
