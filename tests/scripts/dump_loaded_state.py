"""Under torchrun: build the trainer at this world size, load a checkpoint, and write the full
(unsharded) model and optimizer state plus the other restored state to one file (rank 0)."""

import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from dcpkit import dist
from dcpkit.train.config import load_config
from dcpkit.train.trainer import Trainer


def _forbid_metadata_parses() -> None:
    """Every parse of a whole ``.metadata`` fails: the load must read its index alone."""
    from dcpkit import safe_pickle
    from dcpkit.formats import dcp as dcp_format

    def refused(f, where):  # type: ignore[no-untyped-def]
        raise AssertionError(f"{where} parsed whole: the load did not read by its index")

    safe_pickle.load_metadata = refused
    dcp_format.load_metadata = refused


def main() -> None:
    out = sys.argv[1]
    if os.environ.get("FORBID_METADATA_PARSE") == "1":
        _forbid_metadata_parses()
    trainer = Trainer(load_config(sys.argv[2:]))
    step = trainer.checkpoint.load()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(trainer.model, options=full)
    opt_sd = get_optimizer_state_dict(
        trainer.model,
        trainer.optimizer,
        options=StateDictOptions(
            full_state_dict=True, cpu_offload=True, flatten_optimizer_state_dict=True
        ),
    )
    if dist.rank() == 0:
        torch.save(
            {
                "step": step,
                "model": model_sd,
                "optimizer": opt_sd,
                "train_state": trainer.state.state_dict(),
                "dataloader": trainer.loader.state_dict(),
                "lr_scheduler": trainer.scheduler.state_dict(),
            },
            out,
        )
    torch.distributed.barrier()  # no rank leaves while another is still in the group
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter finalization: see dcpkit/train/__main__.py
