"""dcpkit's ModelParallelStrategy (FSDP2) with DcpCheckpointIO wrapped in Lightning's
AsyncCheckpointIO, in one process: refused before the first training step, saying why.

    python lightning_async_fsdp.py
"""

import lightning as L
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.distributed.fsdp import fully_shard

from dcpkit.integrations.lightning import DcpCheckpointIO, ModelParallelStrategy

steps = []


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def configure_model(self):
        fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch, _):
        steps.append(1)
        return self.layer(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = L.Trainer(
    max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
    strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
    plugins=[AsyncCheckpointIO(DcpCheckpointIO())], enable_model_summary=False,
)  # fmt: skip
try:
    trainer.fit(Tiny(), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
except TypeError as e:
    print(f"REFUSED after {len(steps)} steps: {e}")
else:
    print("TRAINED")
