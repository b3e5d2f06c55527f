"""Under torchrun: a per-rank sampler position saved and restored through CheckpointManager.

per_rank_states.py FOLDER save       # every rank saves position 100 * rank + 7
per_rank_states.py FOLDER load       # prints each rank's restored position
per_rank_states.py FOLDER reshard    # the same, through the sampler's own reshard hook
per_rank_states.py FOLDER undeclared # the same sampler in states=: the save must refuse
"""

import json
import os
import sys

import torch
import torch.distributed as torch_dist

from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager, dist


class Sampler:
    def __init__(self) -> None:
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = int(state["position"])


class MergingSampler(Sampler):
    """Resharding itself: rank r takes the sum of the saved ranks r, r + world, ..."""

    def reshard_state_dict(self, saved, rank, world_size):
        return {"position": sum(s["position"] for s in saved[rank::world_size])}


def main() -> None:
    folder, mode = sys.argv[1], sys.argv[2]
    torch_dist.init_process_group("gloo")
    rank = dist.rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    sampler = MergingSampler() if mode == "reshard" else Sampler()
    declared = (
        {"states": {"sampler": sampler}}
        if mode == "undeclared"
        else {"per_rank_states": {"sampler": sampler}}
    )
    config = CheckpointConfig(enable=True, folder=folder, interval=1)
    mgr = CheckpointManager(config, ".", model, **declared)
    if mode in ("save", "undeclared"):
        sampler.position = 100 * rank + 7
        try:
            mgr.save(1)
        except CheckpointError as e:
            sys.stdout.write(f"REFUSED rank {rank}: {e}\n")  # one write: lines never mix
    else:
        assert mgr.load() == 1
        positions = dist.all_gather_object(sampler.position)
        if rank == 0:
            print("POSITIONS " + json.dumps(positions), flush=True)
    mgr.close()
    torch_dist.barrier()  # no rank leaves while another is still in the group
    dist.settle()  # models still refer to the group (dcpkit.dist.settle)
    torch_dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter finalization, where gloo's threads can abort


if __name__ == "__main__":
    main()
