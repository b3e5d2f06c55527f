"""TorchTitan's own Trainer (Llama 3 debug model, FSDP) checkpointing through dcpkit.

    torchrun --nproc-per-node 2 examples/torchtitan_train.py [STOP_AFTER]

TorchTitan builds its checkpointer from `config.checkpoint`: `DcpkitCheckpointManager.Config`
there is all it takes; the Trainer, its loop, model, optimizer, scheduler and dataloader are
TorchTitan's. A small tokenizer and dataset are made on first use (nothing is downloaded).
Run it again: it resumes from its latest checkpoint, bitwise as if never stopped. STOP_AFTER
ends the run early at a checkpoint. CHECKPOINTER=torchtitan writes with TorchTitan's own DCP
manager instead: each resumes the other's checkpoints. On a machine without GPUs,
`run_on_cpu()` lets TorchTitan run on the CPU with gloo.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

from dcpkit.integrations.torchtitan import DcpkitCheckpointManager, run_on_cpu

if not torch.cuda.is_available():
    run_on_cpu()
from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.tools.logging import init_logger

out = Path("outputs/torchtitan")
assets, data = out / "assets", out / "data"
if os.environ["RANK"] == "0" and not (out / "ready").exists():  # a tokenizer and a dataset
    from dcpkit.train.data import corpus_files, train_tokenizer

    files = corpus_files(max_bytes=300_000)  # Python's standard library, as text
    assets.mkdir(parents=True, exist_ok=True)
    train_tokenizer(files, vocab_size=1024).save(str(assets / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (assets / "tokenizer_config.json").write_text(json.dumps(special))
    data.mkdir(exist_ok=True)
    rows = [json.dumps({"text": f.read_text(errors="replace")}) for f in files]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    (out / "ready").touch()
while not (out / "ready").exists():
    time.sleep(0.1)

if os.environ["RANK"] == "0":
    init_logger()  # TorchTitan's log lines, from one process
config = llama3_debugmodel()  # TorchTitan's own config function, then a few changes
manager = CheckpointManager if os.environ.get("CHECKPOINTER") == "torchtitan" else None
options = json.loads(os.environ.get("CHECKPOINT_OPTIONS", "{}"))
config.checkpoint = (manager or DcpkitCheckpointManager).Config(
    **{"enable": True, "interval": 2, "last_save_model_only": False, "keep_latest_k": 0, **options}
)
config.dump_folder = str(out)
config.hf_assets_path = os.environ.get("HF_ASSETS", str(assets))
config.dataloader.dataset_path = str(data)
config.training.steps, config.training.seq_len, config.training.local_batch_size = 8, 64, 2
if not torch.cuda.is_available():  # bfloat16 matmuls are slow on CPUs without bf16 units
    config.training.mixed_precision_param = "float32"
config.validator.enable = False
config.debug.seed = 0  # the same initial weights in every run, to compare runs
config.parallelism.spmd_backend = "partial_dtensor"  # FSDP over the 2 processes
trainer = config.build()
stop_after = int(sys.argv[1]) if len(sys.argv) > 1 else config.training.steps
trainer.should_continue_training = lambda: trainer.step < stop_after
log = trainer.metrics_processor.log


def log_exact(step, loss, *args, **kwargs):  # every step's loss, to the last bit
    if torch.distributed.get_rank() == 0:
        print(f"step {step} loss {float(loss)!r}", flush=True)
    log(step, loss, *args, **kwargs)


trainer.metrics_processor.log = log_exact
try:
    trainer.train()
finally:
    trainer.close()
torch.distributed.barrier()  # no rank leaves while another is still in the group
torch.distributed.destroy_process_group()
