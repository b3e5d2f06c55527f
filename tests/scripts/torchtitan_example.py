"""``examples/torchtitan_train.py`` as the tests run it, less one fixed wait: TorchTitan's
``Trainer.train()`` ends with ``time.sleep(2)`` on rank 0 "for other ranks to complete"; the
example waits for them at its own barrier, so here that sleep returns at once (18 runs of the
suite, 36 s). Everything else is TorchTitan's and the example's: its arguments, environment
and working folder are passed through.

    torchrun --nproc-per-node 2 tests/scripts/torchtitan_example.py [STOP_AFTER]
"""

import runpy
import sys
import time
import types
from pathlib import Path

import torch

from dcpkit.integrations.torchtitan import run_on_cpu

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchtitan_train.py"

if not torch.cuda.is_available():
    run_on_cpu()  # before TorchTitan's Trainer module is imported, as the example does it
import torchtitan.trainer  # noqa: E402

clock = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
torchtitan.trainer.time = types.SimpleNamespace(**{**clock, "sleep": lambda seconds: None})
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
