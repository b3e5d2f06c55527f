"""An evaluation job beside a training run: each new checkpoint exported to Hugging Face and
evaluated with transformers, while the run keeps saving and its retention keeps deleting.

    python examples/evaluation_job.py RUN/checkpoint OUT --model llama3 --flavor debugmodel

By default it follows the run (`dcpkit.follow`): every step the run publishes, in order, none
twice, each held until it is exported, so retention never deletes one first; it ends when the
run does. `--latest` evaluates the newest step instead, again and again (`dcpkit.reading` with
step="latest" chooses and holds it in one operation), skipping those it did already. Each
evaluation is one JSON line on stdout; the exports are OUT/step-N, with the run's tokenizer.
The text evaluated is held out from the run's own data: standard-library files the reference
trainer's default corpus does not hold, tokenized by the run's tokenizer.json (in the run's
folder, beside its checkpoint folder; `--tokenizer` names it for a run saving elsewhere).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

import dcpkit
from dcpkit.convert.hf import to_hf
from dcpkit.readers import run_state
from dcpkit.storage import open_store
from dcpkit.tools.verify import verify_path
from dcpkit.train.data import held_out_files

parser = argparse.ArgumentParser()
parser.add_argument("run", help="the run's checkpoint folder (or its run folder), path or URL")
parser.add_argument("out", help="a folder for the exports, one step-N per step")
parser.add_argument("--model", default="llama3")
parser.add_argument("--flavor", default="debugmodel")
parser.add_argument("--latest", action="store_true", help="evaluate the newest step, repeatedly")
parser.add_argument("--batches", type=int, default=8, help="evaluation batches per step")
parser.add_argument("--tokenizer", help="the run's tokenizer.json (default: in the run's folder)")
args = parser.parse_args()
torch.set_num_threads(1)  # an evaluation job beside training takes what training leaves
data: torch.Tensor | None = None  # read at the first step: the run writes its tokenizer first


def tokenizer_of(held: dcpkit.readers.Reading) -> Path:
    if args.tokenizer:
        return Path(args.tokenizer)
    found = Path(str(held.store.root)).parent / "tokenizer.json"
    if "://" in str(held.store.root) or not found.is_file():
        raise SystemExit(f"no tokenizer.json in the run's folder ({found}): pass --tokenizer")
    return found


def held_out(tokenizer: Path) -> torch.Tensor:
    """``--batches`` batches of 2 x 64 tokens of text the run never trained on."""
    wanted = args.batches * 2 * 64
    text = "".join(p.read_text(errors="replace") for p in held_out_files(wanted * 8))
    ids = Tokenizer.from_file(str(tokenizer)).encode(text).ids[:wanted]
    return torch.tensor(ids).view(args.batches, 2, 64)


def evaluate(held: dcpkit.readers.Reading) -> None:
    global data
    start = time.perf_counter()
    report = verify_path(held.location, checksums=True)  # the step, held while checked
    out = Path(args.out) / held.name
    tokenizer = tokenizer_of(held)
    to_hf(held.location, out, args.model, args.flavor, tokenizer=tokenizer, force=True)
    data = held_out(tokenizer) if data is None else data
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        loss = sum(model(input_ids=b, labels=b).loss.item() for b in data) / len(data)
    newest = max(held.store.published_steps())  # retention keeps 2: the held step would be gone
    line = {"step": int(held.name.split("-")[1]), "verified": report.ok, "eval_loss": loss}
    took = round(time.perf_counter() - start, 2)
    print(json.dumps({**line, "seconds": took, "newest_after": newest}), flush=True)


if not args.latest:
    for held in dcpkit.follow(args.run, purpose="evaluation"):
        evaluate(held)
else:
    done: set[str] = set()
    if not open_store(args.run).published_steps():  # started before the run's first save
        print(f"waiting for a run to save into {args.run}", file=sys.stderr, flush=True)
    while not open_store(args.run).published_steps():
        time.sleep(0.5)
    while True:
        running = run_state(open_store(args.run))[0] == "running"  # before choosing: no gap
        with dcpkit.reading(args.run, step="latest", purpose="evaluation") as held:
            if held.name not in done:
                evaluate(held)
                done.add(held.name)
        if not running:
            break  # the run finished, and its newest step is evaluated
        time.sleep(0.5)
