"""How long a save stalls Lightning under FSDP2: Lightning's own ``ModelParallelStrategy`` (its
synchronous DCP save) beside dcpkit's ``ModelParallelStrategy`` with ``DcpCheckpointIO``
synchronous, ``async`` and ``async_with_pinned_mem``, on the same model, data and steps, 2
processes under torchrun, in one run (the four runs one after the other in the same processes).

    python benchmarks/lightning_stall.py [--dim 512] [--layers 4] [--steps 26] [--every 3]
                                         [--json benchmarks/results/lightning_stall.json]

What a user sees: the wall time between the ends of consecutive training batches on rank 0.
``ModelCheckpoint(every_n_train_steps=N)`` saves at the end of a batch, after the batch's own
hooks, so a save shows in the interval that ends at the next batch; its stall is that interval
minus the median interval of the batches without a save (the first two batches and the first
save, which plans its layout, left out; as ``trainer_stall.py``). Beside it, the time spent in
the strategy's ``save_checkpoint`` (for a background mode: the staging copy, and the wait for
the save before it); the rest of a stall is Lightning's own work of a save (its checkpoint
dict: the model's and optimizer's sharded state dicts, the callbacks' states) and, for a
background mode, the next batch slowed by the write beside it on the same cores. The whole run is
``fit`` until its return (for the background modes: their last save written).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _launch import (  # this script's folder is on sys.path
    llama_config,
    model_options,
    report,
    run_ranks,
    write_results,
)
from trainer_stall import summarize

MODES = ["lightning", "disabled", "async", "async_with_pinned_mem"]


def _one(mode: str, opts: argparse.Namespace, folder: Path) -> dict:
    """One Lightning run in this process (every rank); rank 0's batch ends and sizes."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy as LightningOwn
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from dcpkit.integrations.lightning import DcpCheckpointIO, ModelParallelStrategy

    config = llama_config(opts)
    ends: list[float] = []
    calls: list[float] = []  # the time in each strategy.save_checkpoint (the save itself)

    class Clock(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            ends.append(time.perf_counter())

    class Llama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(config)

        def configure_model(self):
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    L.seed_everything(0, verbose=False)
    tokens = torch.randint(0, opts.vocab, (opts.steps * 4, 64), generator=torch.Generator())
    data = torch.utils.data.DataLoader(tokens, batch_size=2)
    base = LightningOwn if mode == "lightning" else ModelParallelStrategy

    class Timed(base):  # type: ignore[misc,valid-type]
        def save_checkpoint(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            super().save_checkpoint(*args, **kwargs)
            calls.append(time.perf_counter() - start)

    strategy = Timed(data_parallel_size=2, tensor_parallel_size=1)
    plugins = [] if mode == "lightning" else [DcpCheckpointIO(async_mode=mode)]
    saves = ModelCheckpoint(dirpath=folder, every_n_train_steps=opts.every, save_top_k=-1)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, plugins=plugins, max_steps=opts.steps,
        callbacks=[Clock(), saves], logger=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = Llama()
    start = time.perf_counter()
    trainer.fit(module, data)
    total = time.perf_counter() - start
    trainer.strategy.barrier()
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    params = sum(p.numel() for p in module.parameters())  # DTensors: the whole model's
    return {"ends": ends, "calls": calls, "total_s": total, "bytes_on_disk": size, "params": params}


def _ranks(opts: argparse.Namespace) -> None:
    """Under torchrun: every mode in turn; rank 0's result of each reported."""
    import torch.distributed as td

    results = {}
    root = Path(opts._root)
    for mode in MODES:
        folder = root / mode
        results[mode] = _one(mode, opts, folder)
        td.barrier()
        if td.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)
    report(results if td.get_rank() == 0 else None)


def main() -> None:
    p = model_options(__doc__, dim=512, layers=4, vocab=16000)
    p.add_argument("--steps", type=int, default=26)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--_root", default="", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts._root:
        _ranks(opts)
        return
    with tempfile.TemporaryDirectory(prefix="lightning-stall-") as tmp:
        args = [a for a in sys.argv[1:]] + ["--_root", tmp]
        job = run_ranks(str(Path(__file__).resolve()), 2, args)
    if job.returncode != 0 or not job.ranks or job.ranks[0] is None:
        raise SystemExit(f"the runs failed:\n{job.tail}")
    results = {}
    for mode, raw in job.ranks[0].items():
        results[mode] = summarize(raw, opts.every)
        results[mode]["save_call_s"] = statistics.median(raw["calls"][1:])  # the first: plans
    own, ours = results["lightning"], results["disabled"]
    print(f"model: {ours['params'] / 1e6:.0f} M parameters, 2 processes (FSDP2); on disk at the "
          f"end: {own['bytes_on_disk'] / 2**30:.2f} GiB (Lightning) / "
          f"{ours['bytes_on_disk'] / 2**30:.2f} GiB (dcpkit)")  # fmt: skip
    print(f"{'save':<30}{'stall per save':>16}{'in the save call':>18}{'batch without':>15}"
          f"{'whole run':>11}")  # fmt: skip
    for mode, r in results.items():
        name = "Lightning's own (DCP, sync)" if mode == "lightning" else f"dcpkit {mode}"
        print(f"{name:<30}{r['stall_s']:>14.2f} s{r['save_call_s']:>16.2f} s"
              f"{r['step_s']:>13.2f} s{r['total_s']:>9.1f} s")  # fmt: skip
    write_results(opts, ("dim", "layers", "vocab", "steps", "every"), results)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
