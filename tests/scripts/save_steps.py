"""Saves steps 1, 2, ... of a small model to a checkpoint folder (a path or a URL), one process;
with DCPKIT_FAILPOINT set, the process is SIGKILLed where it says.

    save_steps.py FOLDER LAST_STEP
"""

import sys

import torch

from dcpkit import CheckpointConfig, CheckpointManager

folder, last = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
config = CheckpointConfig(enable=True, folder=folder, interval=1, keep_latest_k=0)
with CheckpointManager(config, ".", model) as mgr:
    for step in range(1, last + 1):
        with torch.no_grad():
            model.bias.fill_(float(step))
        mgr.save(step)
        print(f"saved {step}", flush=True)
