"""Under torchrun: each crafted run folder given (``tests/crafted.py``'s cases) loaded on every
rank, with ``verify_on_load`` on and off, as the one-process tests load them. Prints one line
per rank, folder and setting: ``RANK R CASE VERIFY REFUSED message`` or ``... LOADED``.

    crafted_load.py RUN_FOLDER [RUN_FOLDER ...]
"""

import sys
from pathlib import Path

import torch

from dcpkit import CheckpointConfig, CheckpointManager, CorruptCheckpoint, dist
from dcpkit.models import build_model


class Counter:  # the user state the crafted folders hold (tests/conftest.py's)
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


for run in sys.argv[1:]:
    for verify in (True, False):
        torch.manual_seed(0)
        model = build_model("llama3", "debugmodel", max_seq_len=16)
        config = CheckpointConfig(enable=True, interval=1, verify_on_load=verify)
        said = f"RANK {dist.rank()} {Path(run).name} {verify}"
        with CheckpointManager(config, run, model, states={"train_state": Counter()}) as mgr:
            try:
                mgr.load()
                print(said, "LOADED", flush=True)
            except CorruptCheckpoint as e:
                print(said, "REFUSED", " ".join(str(e).split()), flush=True)
