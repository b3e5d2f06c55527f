"""Bytes written per save of a LoRA fine-tune, its frozen base linked from the save before
(``[checkpoint] link_frozen = true``, the default) beside written at every save (``false``),
in one run: the same model, adapters, optimizer and steps under ``CheckpointManager``.

    python benchmarks/frozen_base.py [--dim 512] [--layers 4] [--vocab 8000] [--rank 64]
                                     [--saves 6] [--json benchmarks/results/frozen_base.json]

A ``transformers`` Llama wrapped by PEFT's ``get_peft_model`` (LoRA on every attention
projection): the base's parameters do not train. One training step, then a save, ``--saves``
times. What a save wrote is what its step folder holds that no earlier step does (a linked
file is the earlier step's own, same inode); the first save writes everything in both runs
and is reported apart. Beside it: the base's bytes (the frozen parameters) and the trainable
state's tensors (the adapters, AdamW's two moments and step counts), from the model and
optimizer themselves. One process, on this machine's disk.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from _launch import (  # this script's folder is on sys.path
    llama_config,
    model_options,
    write_results,
)


def _one(link: bool, opts: argparse.Namespace, root: Path) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from dcpkit import CheckpointConfig, CheckpointManager

    torch.manual_seed(0)
    config = llama_config(opts)
    lora = LoraConfig(r=opts.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model = get_peft_model(LlamaForCausalLM(config), lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    cfg = CheckpointConfig(
        enable=True, interval=1, keep_latest_k=0, last_save_model_only=False, link_frozen=link
    )  # fmt: skip
    manager = CheckpointManager(cfg, root, model=model, optimizer=optimizer)
    tokens = torch.randint(0, opts.vocab, (2, 64), generator=torch.Generator().manual_seed(1))
    seen: set[int] = set()
    written, seconds = [], []
    for step in range(1, opts.saves + 1):
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        start = time.perf_counter()
        manager.save(step, last_step=step == opts.saves)
        seconds.append(time.perf_counter() - start)
        files = [f for f in (root / "checkpoint" / f"step-{step}").iterdir() if f.is_file()]
        written.append(sum(f.stat().st_size for f in files if f.stat().st_ino not in seen))
        seen |= {f.stat().st_ino for f in files}
    manager.close()
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    moments = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    state = sum(p.numel() * p.element_size() for p in trainable)
    state += sum(t.numel() * t.element_size() for t in moments)
    return {
        "first_save_bytes": written[0],
        "save_bytes": statistics.median(written[1:]),
        "first_save_s": seconds[0],
        "save_s": statistics.median(seconds[1:]),
        "frozen_bytes": frozen,
        "trainable_state_bytes": state,
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in trainable),
    }


def main() -> None:
    p = model_options(__doc__, dim=512, layers=4, vocab=8000)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--saves", type=int, default=6)
    opts = p.parse_args()
    os.environ.setdefault("WORLD_SIZE", "1")
    results = {}
    with tempfile.TemporaryDirectory(prefix="frozen-base-") as tmp:
        for name, link in (("linked", True), ("written", False)):
            results[name] = _one(link, opts, Path(tmp) / name)
    mib = 2**20
    r = results["linked"]
    print(f"model: {r['params'] / 1e6:.1f} M parameters, {r['trainable_params'] / 1e6:.2f} M "
          f"trainable (LoRA r={opts.rank}); frozen base {r['frozen_bytes'] / mib:.1f} MiB, "
          f"trainable state (adapters + AdamW) {r['trainable_state_bytes'] / mib:.2f} "
          "MiB")  # fmt: skip
    print(f"{'frozen base':<28}{'first save':>14}{'each later save':>18}{'x trainable':>13}"
          f"{'save time':>11}")  # fmt: skip
    for name, r in results.items():
        ratio = r["save_bytes"] / r["trainable_state_bytes"]
        print(f"{name + ' once' if name == 'linked' else 'written at every save':<28}"
              f"{r['first_save_bytes'] / mib:>10.2f} MiB{r['save_bytes'] / mib:>14.2f} MiB"
              f"{ratio:>12.2f}x{r['save_s']:>9.3f} s")  # fmt: skip
    write_results(opts, ("dim", "layers", "vocab", "rank", "saves"), results)


if __name__ == "__main__":
    main()
