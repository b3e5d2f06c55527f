"""TorchTitan's own Llama 3 debug model, loaded from a checkpoint in one process, and its logits
on fixed tokens (a safetensors file), to compare with an export's.

    torchtitan_logits.py CHECKPOINT OUT.safetensors
"""

import sys

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

from dcpkit.integrations.torchtitan import run_on_cpu

run_on_cpu()
from torchtitan.components.checkpointer import ModelWrapper  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

checkpoint, out = sys.argv[1], sys.argv[2]
model = model_registry("debugmodel").model.build()
wrapper = ModelWrapper(model)
state = {k: v.detach().clone() for k, v in wrapper.state_dict().items()}
dcp.load(state, checkpoint_id=checkpoint, no_dist=True)  # DCP's own reader, TorchTitan's names
wrapper.load_state_dict(state)
model.eval()
tokens = torch.randint(0, 2048, (2, 24), generator=torch.Generator().manual_seed(7))
positions = torch.arange(24).expand(2, 24)
with torch.no_grad():
    logits = model(tokens, positions, model.get_attention_masks(positions))
save_file({"tokens": tokens, "logits": logits.contiguous()}, out)
