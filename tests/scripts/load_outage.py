"""Under torchrun: a 2-rank FSDP2 model saved to and loaded from an object store whose endpoint
(a proxy the test controls) may stop answering during the load.

    load_outage.py FOLDER ENDPOINT save            # saves step 1
    load_outage.py FOLDER ENDPOINT load RETRY_S MARKER   # loads it; MARKER is created as load()
                                                         # starts, MARKER.R as rank R has its
                                                         # result

Each rank prints ``STATE rank R HASH`` (its shards' bytes) after the save or a load that
succeeded, or ``FAILED rank R SECONDS TYPE: MESSAGE`` for a load that raised; a rank that
catches the error goes on, to a barrier every rank must reach (none is left waiting).
"""

import hashlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointManager, dist


def build(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(16)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def state_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def say(line: str) -> None:
    """One write per line (stdout is unbuffered): two ranks' lines never mix."""
    sys.stdout.write(line + "\n")


def main() -> None:
    folder, endpoint, phase = sys.argv[1:4]
    torch_dist.init_process_group("gloo")
    rank = dist.rank()
    retry_s = float(sys.argv[4]) if phase == "load" else 30.0
    cfg = CheckpointConfig(
        enable=True, folder=folder, interval=1, keep_latest_k=0, storage_retry_s=retry_s,
        storage_options={
            "endpoint_url": endpoint,
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2,
                              "read_timeout": 5},
        },
    )  # fmt: skip
    model = build(0 if phase == "save" else 1)
    mgr = CheckpointManager(cfg, ".", model)
    if phase == "save":
        mgr.save(1)
        mgr.wait()
        say(f"STATE rank {rank} {state_hash(model)}")
    else:
        torch_dist.barrier()
        if rank == 0:
            Path(sys.argv[5]).touch()
        start = time.monotonic()
        try:
            mgr.load()
            took = time.monotonic() - start
            say(f"STATE rank {rank} {state_hash(model)} {took:.2f}")
        except Exception as e:  # a caller that catches it and goes on
            took = time.monotonic() - start
            say(f"FAILED rank {rank} {took:.1f} {type(e).__name__}: {e}")
        Path(f"{sys.argv[5]}.{rank}").touch()
    torch_dist.barrier()
    mgr.close()
    torch_dist.barrier()
    dist.settle()  # models still refer to the group (dcpkit.dist.settle)
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
