"""``make demo``: a 2-rank training run that checkpoints, is interrupted, resumes exactly, and
resumes again at another world size and as a pipeline; then a mixture of experts whose experts
are sharded over 2 ranks, resumed on 1 and exported to transformers.

Every figure printed is read back from the runs' own ``metrics.jsonl`` and checkpoints.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from pathlib import Path

from dcpkit.cli import main as cli_main
from dcpkit.launch import run_training
from dcpkit.storage import open_store
from dcpkit.tools.plot import plot_runs
from dcpkit.tools.report import render_report
from dcpkit.train import CONFIGS
from dcpkit.train.metrics import read_run

CONFIG = CONFIGS / "llama3_debugmodel.toml"
MOE_CONFIG = CONFIGS / "qwen3_moe_debugmodel.toml"
OUT = Path("demo_out")


def banner(text: str) -> None:
    print(f"\n=== {text} " + "=" * max(0, 74 - len(text)), flush=True)


def train(nproc: int, dump: Path, *overrides: str, config: Path = CONFIG) -> None:
    args = ["--job.config_file", str(config), "--job.dump_folder", str(dump), *overrides]
    code = run_training(nproc, args, on_line=lambda line: print("   ", line, end=""))
    if code != 0:
        raise SystemExit(f"demo: training exited with code {code}")


def metrics(dump: Path) -> dict[int, dict]:
    return read_run(dump).steps


def main() -> int:
    if not CONFIG.is_file():
        raise SystemExit(f"demo: {CONFIG} is missing; reinstall dcpkit")
    start = time.time()
    shutil.rmtree(OUT, ignore_errors=True)
    full, interrupted, one_rank = OUT / "full", OUT / "interrupted", OUT / "one_rank"
    pipelined = OUT / "pipelined"

    banner("1. 2 ranks, 20 steps, a checkpoint every 2 steps (uninterrupted reference)")
    train(2, full, "--checkpoint.interval", "2")

    banner("2. the same run with async_with_pinned_mem, stopped after step 10 (a preemption)")
    train(
        2,
        interrupted,
        "--training.stop_at_step",
        "10",
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        "async_with_pinned_mem",
    )
    print("\n    $ dcpkit list", interrupted / "checkpoint")
    cli_main(["list", str(interrupted / "checkpoint")])

    banner("3. verify step-10 (sizes, xxh3 checksums, DCP structure), then resume on 2 ranks")
    print("    $ dcpkit verify", interrupted / "checkpoint" / "step-10")
    if cli_main(["verify", str(interrupted / "checkpoint" / "step-10")]) != 0:
        raise SystemExit("demo: the checkpoint to resume from failed verification")
    for copy in (one_rank, pipelined):  # for the reshards below
        shutil.copytree(interrupted / "checkpoint" / "step-10", copy / "checkpoint" / "step-10")
    train(
        2,
        interrupted,
        "--checkpoint.interval",
        "2",
        "--checkpoint.async_mode",
        "async_with_pinned_mem",
    )

    banner("4. resume the step-10 checkpoint on 1 rank (reshard 2 -> 1)")
    train(1, one_rank)

    banner("5. resume it again as a 2-stage pipeline on 2 ranks (FSDP 2 -> PP 2, 1F1B)")
    train(2, pipelined, "--parallelism.pipeline_parallel_degree", "2")

    ref, resumed, resharded = metrics(full), metrics(interrupted), metrics(one_rank)
    staged = metrics(pipelined)
    banner("loss per step")
    print(
        f"    {'step':>4}  {'uninterrupted':>14}  {'resumed (2)':>14}  {'resharded (1)':>14}  "
        f"{'PP 2 (2)':>14}  {'2 vs ref':>9}  {'1 vs ref':>9}  {'PP vs ref':>9}"
    )
    bitwise = True
    worst = worst_pp = 0.0
    for step in sorted(ref):
        a, b = ref[step]["loss"], resumed[step]["loss"]
        same = a == b
        bitwise &= same
        c = resharded.get(step, {}).get("loss")
        d = staged.get(step, {}).get("loss")
        rel = "" if c is None else f"{abs(c - a) / abs(a):9.1e}"
        rel_pp = "" if d is None else f"{abs(d - a) / abs(a):9.1e}"
        if c is not None:
            worst = max(worst, abs(c - a) / abs(a))
        if d is not None:
            worst_pp = max(worst_pp, abs(d - a) / abs(a))
        print(
            f"    {step:>4}  {a:>14.8f}  {b:>14.8f}  "
            f"{'' if c is None else f'{c:14.8f}':>14}  {'' if d is None else f'{d:14.8f}':>14}  "
            f"{'same' if same else 'DIFFERENT':>9}  {rel:>9}  {rel_pp:>9}"
        )
    banner("checkpoint stall: training time blocked by each save")
    print("    async: the save's step plus the next one, which waits for the memory copy")
    print(f"    {'step':>6}  {'sync (run 1)':>13}  {'async_with_pinned_mem':>22}")
    steady_sync, steady_async = [], []
    for step in sorted(s for s, r in ref.items() if r["checkpoint_saved"]):
        sync_stall = ref[step]["checkpoint_stall_s"]
        async_stall = resumed[step]["checkpoint_stall_s"] + resumed.get(step + 1, {}).get(
            "checkpoint_stall_s", 0.0
        )
        note = ""
        if step in (10, 20):
            note = "  stop / last step: synchronous by design"
        elif step in (2, 12):
            note = "  first save of the process: buffers allocated"
        else:
            steady_sync.append(sync_stall)
            steady_async.append(async_stall)
        print(f"    {step:>6}  {sync_stall:>12.3f}s  {async_stall:>21.3f}s{note}")
    print(
        f"    median of the other saves: sync {statistics.median(steady_sync):.3f}s, async "
        f"{statistics.median(steady_async):.3f}s (a 72 MiB state on 2 busy cores; "
        "benchmarks/async_stall.py measures 1.5 GiB)"
    )
    banner("summary")
    print(
        f"    resume on 2 ranks: {'bitwise identical' if bitwise else 'DIFFERENT'} loss at "
        f"all {len(ref)} steps"
    )
    print(
        f"    resume on 1 rank:  max relative loss difference {worst:.1e} (reduction order "
        f"differs with the world size); tokens seen identical: "
        f"{all(resharded[s]['tokens_seen'] == ref[s]['tokens_seen'] for s in resharded)}"
    )
    print(
        f"    resume as PP 2:    max relative loss difference {worst_pp:.1e} (the same "
        "checkpoint, parameters by name, stages of 3 layers each)"
    )
    print(
        f"    published checkpoints: {open_store(full / 'checkpoint').published_steps()} "
        f"(keep_latest_k = 3)"
    )

    banner("6. export step-20 to Hugging Face, verified, and generate with transformers")
    hf = OUT / "hf_export"
    print(
        f"    $ dcpkit to-hf {full / 'checkpoint' / 'step-20'} {hf} --model llama3 "
        f"--flavor debugmodel --tokenizer {full / 'tokenizer.json'} --verify"
    )
    code = cli_main(
        [
            "to-hf",
            str(full / "checkpoint" / "step-20"),
            str(hf),
            "--model",
            "llama3",
            "--flavor",
            "debugmodel",
            "--tokenizer",
            str(full / "tokenizer.json"),
            "--verify",
        ]
    )
    if code != 0:
        return code
    generate(hf, "20 steps of a 6M-parameter model")

    worst_moe = moe()

    banner("8. the loss curves, overlaid, and a report of the resumed run")
    names = [
        "uninterrupted (2 ranks)",
        "stopped at 10, resumed (2)",
        "resumed from 10 on 1 rank",
        "resumed from 10 as PP 2",
    ]
    runs = [full, interrupted, one_rank, pipelined]
    quoted = " ".join(f'"{n}"' for n in names)
    print(f"    $ dcpkit plot {' '.join(map(str, runs))} -o {OUT / 'loss.png'} --names {quoted}")
    plot_runs([read_run(r) for r in runs], OUT / "loss.png", names)
    print(f"    $ dcpkit report {interrupted} -o {OUT / 'report.html'} --compare {full}")
    render_report(interrupted, OUT / "report.html", compare=[full])
    print(f"    loss curves: {(OUT / 'loss.png').resolve()}")
    print(f"    report:      {(OUT / 'report.html').resolve()} (self-contained; open it anywhere)")
    print(f"\n    outputs in {OUT.resolve()}  ({time.time() - start:.0f}s)")
    ok = bitwise and worst < 1e-3 and worst_pp < 1e-3 and worst_moe < 1e-3
    return 0 if ok else 1


def moe() -> float:
    """A mixture-of-experts run with its experts sharded over 2 ranks, resumed on 1, exported."""
    ep2, ep1 = OUT / "moe_ep2", OUT / "moe_ep1"
    banner("7. Qwen 3 MoE: 8 experts sharded over 2 ranks (EP 2), then resumed on 1 rank (EP 1)")
    train(2, ep2, "--training.steps", "10", "--checkpoint.interval", "5", config=MOE_CONFIG)
    shutil.copytree(ep2 / "checkpoint" / "step-5", ep1 / "checkpoint" / "step-5")
    train(
        1,
        ep1,
        "--training.steps",
        "10",
        "--checkpoint.interval",
        "5",
        "--parallelism.expert_parallel_degree",
        "1",
        config=MOE_CONFIG,
    )
    ref, resumed = metrics(ep2), metrics(ep1)
    print(f"    {'step':>4}  {'EP 2 (2 ranks)':>15}  {'EP 1 (1 rank)':>15}  {'rel diff':>9}")
    worst = 0.0
    for step in sorted(resumed):
        a, b = ref[step]["loss"], resumed[step]["loss"]
        worst = max(worst, abs(a - b) / abs(a))
        print(f"    {step:>4}  {a:>15.8f}  {b:>15.8f}  {abs(a - b) / abs(a):>9.1e}")
    hf = OUT / "moe_hf_export"
    step10 = ep1 / "checkpoint" / "step-10"
    print(
        f"    $ dcpkit to-hf {step10} {hf} --model qwen3_moe --flavor debugmodel "
        f"--tokenizer {ep2 / 'tokenizer.json'} --verify"
    )
    argv = ["to-hf", str(step10), str(hf), "--model", "qwen3_moe", "--flavor", "debugmodel"]
    argv += ["--tokenizer", str(ep2 / "tokenizer.json"), "--verify"]
    if cli_main(argv) != 0:
        raise SystemExit("demo: the MoE export failed")
    generate(hf, "10 steps of a 5M-parameter mixture of experts")
    return worst


def generate(folder: Path, what: str) -> None:
    """Load the export with transformers alone and continue a prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    prompt = "def __init__(self"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    text = tokenizer.decode(out[0])
    print(
        f"    transformers: {type(model).__name__}, {model.num_parameters() / 1e6:.1f}M "
        f"parameters, tokenizer with {len(tokenizer)} tokens"
    )
    print(f"    prompt {prompt!r} -> {text!r}")
    print(f"    ({what}: expect Python-flavoured noise, not code)")


if __name__ == "__main__":
    sys.exit(main())
