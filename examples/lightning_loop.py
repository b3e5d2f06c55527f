"""A PyTorch Lightning training run whose checkpoints dcpkit writes, verifies and reads.

    torchrun --nproc-per-node 2 examples/lightning_loop.py [STOP_AFTER_EPOCHS]

A LightningModule holding a tiny `transformers` Llama (with dropout), trained by Lightning's own
`Trainer` with DDP (or, with STRATEGY=fsdp, sharded by FSDP2 under dcpkit's
`ModelParallelStrategy`), its `ModelCheckpoint` (top 2 by loss, and `last`) saving through
`DcpCheckpointIO` (under FSDP2, ASYNC_MODE=async saves in the background); `RNGState` keeps
every process's RNG. Run it again: `ckpt_path="last"` resumes from the last checkpoint,
bitwise as if never stopped. Checkpoints are folders in
./outputs/lightning/checkpoints; `dcpkit verify` and `dcpkit to-hf` take any of them.
"""

import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from dcpkit import HFModel
from dcpkit.integrations.lightning import DcpCheckpointIO, ModelParallelStrategy, RNGState

config = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1,
)  # fmt: skip


class TinyLlama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(config)

    def configure_model(self):  # with ModelParallelStrategy: FSDP2 over its data-parallel mesh
        if self.device_mesh is not None:
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        if self.global_rank == 0:
            print(f"step {self.global_step + 1} loss {loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)]


epochs = 4
stop_after = int(sys.argv[1]) if len(sys.argv) > 1 else epochs
L.seed_everything(0)
tokens = torch.randint(0, config.vocab_size, (64, 16), generator=torch.Generator().manual_seed(1))
data = torch.utils.data.DataLoader(tokens, batch_size=4, shuffle=True)
folder = Path("outputs/lightning/checkpoints")
every = int(os.environ.get("SAVE_EVERY_N_STEPS", "0"))  # 8: each epoch's last batch, kept
kept = {"every_n_train_steps": every, "save_top_k": -1} if every else {"monitor": "train_loss"}
checkpoints = ModelCheckpoint(dirpath=folder, **{"save_top_k": 2, "save_last": True, **kept})
fsdp = os.environ.get("STRATEGY") == "fsdp"
strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if fsdp else "ddp"
trainer = L.Trainer(
    accelerator="cpu", devices=2, strategy=strategy, max_epochs=stop_after,
    plugins=[DcpCheckpointIO(model_prefix="model.", hf_model=HFModel("hf", config),
                             async_mode=os.environ.get("ASYNC_MODE", "disabled"))],
    callbacks=[checkpoints, RNGState()],
    logger=False, enable_progress_bar=False, enable_model_summary=False,
)  # fmt: skip
trainer.fit(TinyLlama(), data, ckpt_path="last" if (folder / "last.ckpt").exists() else None)
if stop_after == epochs:  # the trained model, to compare an export (every process gathers)
    full = trainer.strategy.lightning_module_state_dict() if not fsdp else None
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(trainer.lightning_module, options=options)
    if trainer.is_global_zero:
        trained = LlamaForCausalLM(config)
        trained.load_state_dict({k.removeprefix("model."): v for k, v in full.items()})
        trained.save_pretrained("outputs/lightning/final")
