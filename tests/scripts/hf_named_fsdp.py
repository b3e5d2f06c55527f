"""Under torchrun (2 ranks): a transformers model (Llama or Qwen 3) trained 4 steps under FSDP2
with CheckpointManager, a user state beside it; writes its config.json and, on rank 0, the
trained model's logits on fixed tokens (a safetensors file) for the test to compare with.

    hf_named_fsdp.py OUT llama|qwen3 [hf_last]

With ``hf_last``: ``HFModel("hf", model.config)`` (the model's own transformers config) and
``last_save_in_hf``: the last step is published as a Hugging Face folder; a second manager on the
folder, in the same process, must be refused (prints SECOND REFUSED).
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as torch_dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager, HFModel, dist

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


class Data:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step, "gen": torch.arange(4)}

    def load_state_dict(self, state):
        self.step = int(state["step"])


def build(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=16, tie_word_embeddings=True))


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    torch_dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = build(kind)
    model.config.to_json_file(str(out / "config.json")) if dist.rank() == 0 else None
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Data()
    hf_last = sys.argv[3:] == ["hf_last"]
    cfg = CheckpointConfig(
        enable=True, folder=str(out / "checkpoint"), interval=4 if not hf_last else 2,
        last_save_model_only=hf_last, last_save_in_hf=hf_last,
    )  # fmt: skip
    hf_model = HFModel("hf", model.config) if hf_last else None
    mgr = CheckpointManager(cfg, out, model, opt, states={"data": data}, hf_model=hf_model)
    gen = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        tokens = torch.randint(0, TINY["vocab_size"], (2, 16), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        mgr.maybe_wait_for_staging()
        opt.step()
        opt.zero_grad()
        data.step = step
        mgr.save(step, last_step=hf_last and step == 4)
        if hf_last and step == 2:
            try:
                CheckpointManager(cfg, out, build(kind), states={"data": Data()}, hf_model=hf_model)
            except CheckpointError as e:
                sys.stdout.write(f"SECOND REFUSED: {e}\n")  # one write: lines never mix
    mgr.close()
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.rank() == 0:
        reference = build(kind).eval()
        reference.load_state_dict(full, strict=False)
        if reference.config.tie_word_embeddings:
            reference.tie_weights()
        tokens = torch.randint(
            0, TINY["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(7)
        )
        with torch.no_grad():
            logits = reference(input_ids=tokens).logits
        save_file(
            {"tokens": tokens, "logits": logits.contiguous()}, str(out / "expected.safetensors")
        )
        print("TRAINED", flush=True)
    torch_dist.barrier()  # no rank leaves while another is still in the group
    torch_dist.destroy_process_group()
    sys.stdout.flush()
    # Nothing is left to do: skip interpreter finalization, where gloo's threads can abort.
    os._exit(0)


if __name__ == "__main__":
    main()
