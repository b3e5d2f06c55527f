"""The transformers ``Trainer`` on 2 processes (DDP, CPU) checkpointing through dcpkit's mixin:
a tiny Llama with attention dropout, a shuffled dataset, 2 micro-batches per step.

    torchrun --nproc-per-node 2 examples/transformers_trainer.py OUTPUT_DIR [STOP_AT] [--resume]
        [--last-checkpoint]

``--last-checkpoint`` resumes as transformers' example scripts do, from the ``checkpoint-N`` that
``get_last_checkpoint(OUTPUT_DIR)`` finds. Prints ``loss RANK STEP MICRO VALUE`` for every
micro-batch (each rank's, to the last bit).
ASYNC_MODE sets dcpkit's ``async_mode``; TRAINER=own uses the Trainer's own saves;
TRAINER=sft trains with TRL's ``SFTTrainer`` (a pre-tokenized dataset, a small tokenizer);
LORA=1 trains PEFT LoRA adapters of the model instead of the model (with TRAINER=sft, as TRL's
users do: ``SFTTrainer(peft_config=...)``); EVAL=1 evaluates at each
save (``metric_for_best_model``) and ends with the best step's model, written to
OUTPUT_DIR/final-model.pt.
"""

import os
import sys

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from dcpkit import CheckpointConfig
from dcpkit.integrations.transformers import DcpkitTrainerMixin

out = sys.argv[1]
stop = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 0
resume = "--resume" in sys.argv
kind = os.environ.get("TRAINER", "dcpkit")


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (48, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if stop and state.global_step >= stop:
            control.should_training_stop = True


class Printing:
    micro = 0

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        step, rank = self.state.global_step + 1, self.args.process_index
        sys.stdout.write(f"loss {rank} {step} {self.micro % 2} {loss.item()!r}\n")
        sys.stdout.flush()
        self.micro += 1
        return loss


class DcpkitTrainer(Printing, DcpkitTrainerMixin, Trainer):
    pass


class OwnTrainer(Printing, Trainer):
    pass


torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    attention_dropout=0.1,
)  # fmt: skip
model = LlamaForCausalLM(config)
model.config._attn_implementation = "eager"
lora = None
if os.environ.get("LORA"):  # a LoRA fine-tune: the Trainer's no-decay parameter group is empty
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    if kind != "sft":  # TRL wraps the model itself, given peft_config
        model = get_peft_model(model, lora)
evaluate = {}  # EVAL: evaluated at each save; the best step's model loaded at the end
if os.environ.get("EVAL"):
    evaluate = {"eval_strategy": "steps", "eval_steps": 3, "load_best_model_at_end": True,
                "metric_for_best_model": "eval_loss", "greater_is_better": True}  # fmt: skip
args = TrainingArguments(
    output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2,
    max_steps=14, save_strategy="steps", save_steps=3, logging_steps=1, learning_rate=1e-3,
    seed=0, report_to=[], use_cpu=True, disable_tqdm=True, ddp_backend="gloo",
    save_total_limit=int(os.environ.get("SAVE_TOTAL_LIMIT", "0")) or None, **evaluate,
)  # fmt: skip
kwargs = {"model": model, "args": args, "train_dataset": Tokens(), "callbacks": [StopAt()]}
if os.environ.get("EVAL"):
    kwargs["eval_dataset"] = Tokens()
dcpkit_config = CheckpointConfig(async_mode=os.environ.get("ASYNC_MODE", "disabled"))
if kind == "own":
    trainer = OwnTrainer(**kwargs)
elif kind == "sft":
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    class DcpkitSFTTrainer(Printing, DcpkitTrainerMixin, SFTTrainer):
        pass

    vocab = {f"t{i}": i for i in range(128)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        pad_token="t0", eos_token="t1",
    )  # fmt: skip
    kwargs["args"] = SFTConfig(**{**args.to_dict(), "max_length": 16, "packing": False})
    ids = Tokens().ids.tolist()
    kwargs["train_dataset"] = Dataset.from_dict({"input_ids": ids})
    trainer = DcpkitSFTTrainer(
        **kwargs, processing_class=tokenizer, peft_config=lora, dcpkit_config=dcpkit_config
    )
else:
    trainer = DcpkitTrainer(**kwargs, dcpkit_config=dcpkit_config)
if "--last-checkpoint" in sys.argv:  # how transformers' example scripts (run_clm.py) resume
    from transformers.trainer_utils import get_last_checkpoint

    trainer.train(resume_from_checkpoint=get_last_checkpoint(out) if os.path.isdir(out) else None)
else:
    trainer.train(resume_from_checkpoint=True if resume else None)
if os.environ.get("EVAL") and trainer.args.process_index == 0:  # the weights the run ends with
    torch.save(trainer.model.state_dict(), os.path.join(out, "final-model.pt"))
torch.distributed.barrier()
