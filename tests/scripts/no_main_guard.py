"""Under torchrun: a user's script with no ``if __name__ == "__main__":`` guard, saving with
``async_with_pinned_mem`` (whose writer is a spawned process): it must save, not hang.

no_main_guard.py FOLDER    # prints "SAVED [1, 2]"
"""

import sys

import torch
import torch.distributed as td

from dcpkit import CheckpointConfig, CheckpointManager

td.init_process_group("gloo")
model = torch.nn.Linear(4, 4)
config = CheckpointConfig(
    enable=True, folder=sys.argv[1], async_mode="async_with_pinned_mem", interval=1
)
with CheckpointManager(config, ".", model) as mgr:
    mgr.save(1)  # staged, written by the writer process in the background
    mgr.save(2)
sys.stdout.write(f"SAVED {mgr.published_steps()}\n")  # one write: ranks' lines never mix
td.destroy_process_group()
