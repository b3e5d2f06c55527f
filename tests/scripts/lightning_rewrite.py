"""Rewrites Lightning's ``last.ckpt`` through ``DcpCheckpointIO``, as ``ModelCheckpoint(
save_last=True)`` does at every save: global steps 1, 2, 3 into FOLDER/last.ckpt, in one process.

    python lightning_rewrite.py FOLDER [swap|renames]

``renames``: the file system's exchange of two folders taken away (the fallback of two
renames). Run with ``DCPKIT_FAILPOINT`` to be killed in the middle of a rewrite.
"""

import sys

import torch

import dcpkit.storage.local as local
from dcpkit.integrations.lightning import DcpCheckpointIO

if len(sys.argv) > 2 and sys.argv[2] == "renames":
    local.exchange = lambda a, b: False
io = DcpCheckpointIO()
for step in (1, 2, 3):
    checkpoint = {"state_dict": {"w": torch.full((4, 4), float(step))}, "global_step": step}
    io.save_checkpoint(checkpoint, f"{sys.argv[1]}/last.ckpt")
    print(f"saved {step}", flush=True)
