"""How long a save stalls the transformers ``Trainer``: its own ``_save_checkpoint`` beside
dcpkit's mixin (``DcpkitTrainerMixin``) synchronous, ``async`` and ``async_with_pinned_mem``,
on the same model, data and steps, one process each (forked from one that imported torch
and transformers once), in one run.

    python benchmarks/trainer_stall.py [--dim 768] [--layers 6] [--steps 26] [--every 3]
                                       [--json benchmarks/results/trainer_stall.json]

What a user sees: the wall time between the ends of consecutive optimizer steps. A step after
which the Trainer saved takes longer by what the save blocked (the save itself, and for an
asynchronous save the wait for its memory copy before the next optimizer step); its stall is
that step's interval minus the median interval of the steps without a save. The first two
steps (warm-up) and the first save (a first save plans its layout) are left out of the medians.
A background write competes with training for the CPU: the steps without a save and the whole
run's time (until the last save is written) are reported beside the stall.
The Trainer's own save writes the model (safetensors), optimizer, scheduler, RNG and state
files of ``checkpoint-N``; dcpkit writes the same state to ``checkpoint/step-N``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from _launch import (  # this script's folder is on sys.path
    forked,
    llama_config,
    model_options,
    write_results,
)

MODES = ["trainer", "disabled", "async", "async_with_pinned_mem"]


def _preload() -> None:
    """What each run imports, imported once here: each run's process is forked from this one
    (a process of its own, nothing of another mode's run in it), without paying the imports."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import dcpkit.integrations.transformers  # noqa: F401


def _forked(mode: str, opts: argparse.Namespace, out: Path, result: Path) -> None:
    """``_one`` in a child process forked from this one; raises when it failed."""

    def work() -> bool:
        os.environ["WORLD_SIZE"] = "1"
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            _one(mode, opts, out, result)
        return True

    if forked(work, f"the {mode} run") is None:
        raise SystemExit(f"the {mode} run failed")


def _one(mode: str, opts: argparse.Namespace, out: Path, result: Path) -> None:
    """One Trainer run in this process; its step intervals and save steps to ``result``."""
    import torch
    from transformers import (
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from dcpkit import CheckpointConfig
    from dcpkit.integrations.transformers import DcpkitTrainerMixin

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, opts.vocab, (64, 64), generator=torch.Generator())

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    class Dcpkit(DcpkitTrainerMixin, Trainer):
        pass

    torch.manual_seed(0)
    config = llama_config(opts)
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=opts.steps,
        save_strategy="steps", save_steps=opts.every, logging_steps=opts.steps, seed=0,
        report_to=[], use_cpu=True, disable_tqdm=True, learning_rate=1e-4,
    )  # fmt: skip
    kwargs = {"model": model, "args": args, "train_dataset": Tokens(), "callbacks": [Clock()]}
    if mode == "trainer":
        trainer = Trainer(**kwargs)
    else:
        trainer = Dcpkit(**kwargs, dcpkit_config=CheckpointConfig(async_mode=mode))
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start  # for dcpkit: its last save written and published
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    saves = opts.steps // opts.every
    result.write_text(json.dumps({
        "ends": ends, "total_s": total, "bytes_on_disk": size, "saves": saves,
        "params": sum(p.numel() for p in model.parameters()),
    }))  # fmt: skip


def summarize(raw: dict, every: int) -> dict:
    """Each save's stall (its step's interval minus the median interval without a save)."""
    ends = raw["ends"]
    intervals = {step: ends[step - 1] - ends[step - 2] for step in range(2, len(ends) + 1)}
    saved = {s for s in range(every, len(ends) + 1, every)}
    # a save after step s shows in the interval that ends at step s + 1
    plain = [v for s, v in intervals.items() if s > 3 and s - 1 not in saved]
    base = statistics.median(plain)
    stalls = [intervals[s + 1] - base for s in sorted(saved) if s + 1 in intervals and s > every]
    return {
        "step_s": base,
        "stall_s": statistics.median(stalls),
        "stalls_s": stalls,
        "total_s": raw["total_s"],
        "bytes_on_disk": raw["bytes_on_disk"],
        "params": raw["params"],
    }


def main() -> None:
    p = model_options(__doc__, dim=768, layers=6, vocab=16000)
    p.add_argument("--steps", type=int, default=26)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--_mode", default="", help=argparse.SUPPRESS)
    p.add_argument("--_out", default="", help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts._mode:
        with tempfile.TemporaryDirectory(prefix="trainer-stall-") as tmp:
            _one(opts._mode, opts, Path(tmp) / "run", Path(opts._out))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="trainer-stall-") as tmp:
        _preload()
        for mode in MODES:
            out = Path(tmp) / f"{mode}.json"
            _forked(mode, opts, Path(tmp) / "run", out)
            results[mode] = summarize(json.loads(out.read_text()), opts.every)
            shutil.rmtree(Path(tmp) / "run", ignore_errors=True)
    first = results["trainer"]
    gib = {mode: r["bytes_on_disk"] / 2**30 for mode, r in results.items()}
    print(f"model: {first['params'] / 1e6:.0f} M parameters; on disk at the end: "
          f"{gib['trainer']:.2f} GiB (Trainer) / {gib['disabled']:.2f} GiB (dcpkit)")  # fmt: skip
    print(f"{'save':<30}{'stall per save':>16}{'step without a save':>22}{'whole run':>12}")
    for mode, r in results.items():
        name = "Trainer's own save" if mode == "trainer" else f"dcpkit {mode}"
        print(f"{name:<30}{r['stall_s']:>14.2f} s{r['step_s']:>20.2f} s{r['total_s']:>10.1f} s")
    write_results(opts, ("dim", "layers", "vocab", "steps", "every"), results)


if __name__ == "__main__":
    main()
