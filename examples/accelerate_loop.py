"""A Hugging Face Accelerate training loop whose checkpoints dcpkit writes and restores.

    torchrun --nproc-per-node 2 examples/accelerate_loop.py [STOP_AFTER]

A tiny `transformers` Llama, trained with Accelerate (DDP; `cpu=True` on a machine without
GPUs), with `AcceleratorCheckpoint` in place of `accelerator.save_state()` / `load_state()`.
Run it again and it resumes from its latest checkpoint, bitwise as if never stopped: model,
AdamW, scheduler, every process's RNG (dropout) and the dataloader's position mid-epoch.
STOP_AFTER stops it early (it saves that step first). Checkpoints go to
./outputs/accelerate/checkpoint/step-N; `dcpkit to-hf` exports one with no other argument.
LORA=1 fine-tunes PEFT LoRA adapters of the model instead of the model (its base frozen).
"""

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from transformers import LlamaConfig, LlamaForCausalLM

from dcpkit import CheckpointConfig, HFModel
from dcpkit.integrations.accelerate import AcceleratorCheckpoint

# A stateful dataloader and a seedable sampler: a resumed epoch goes on where it stopped.
data_config = DataLoaderConfiguration(use_stateful_dataloader=True, use_seedable_sampler=True)
accelerator = Accelerator(cpu=not torch.cuda.is_available(), dataloader_config=data_config)
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.1,
)  # fmt: skip
model = LlamaForCausalLM(config)
if os.environ.get("LORA"):  # adapters trained, the base frozen
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    model = get_peft_model(model, lora)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.7)
tokens = torch.randint(0, config.vocab_size, (96, 16), generator=torch.Generator().manual_seed(1))
data = torch.utils.data.DataLoader(tokens, batch_size=4, shuffle=True)
model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)

steps = 16  # 12 batches per process per epoch: the run crosses an epoch
stop_after = int(sys.argv[1]) if len(sys.argv) > 1 else steps
ckpt_config = CheckpointConfig(enable=True, interval=4, async_mode="async", keep_latest_k=0)
with AcceleratorCheckpoint(
    accelerator, "outputs/accelerate", model, optimizer, scheduler, data,
    config=ckpt_config, hf_model=HFModel("hf", config),
) as ckpt:  # fmt: skip
    step = ckpt.load_state() or 0  # the latest checkpoint, or None: a fresh start
    while step < stop_after:
        for batch in data:  # a resumed dataloader goes on mid-epoch
            step += 1
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            ckpt.maybe_wait_for_staging()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            accelerator.print(f"step {step} loss {loss.item()!r}")
            ckpt.save_state(step, last_step=step == steps, force=step == stop_after)
            if step == stop_after:
                break
if accelerator.is_main_process and stop_after == steps:  # Accelerate's own export, to compare
    accelerator.unwrap_model(model).save_pretrained("outputs/accelerate/final")
accelerator.end_training()
