"""An evaluation job beside a training run: each new checkpoint exported to Hugging Face and
evaluated with transformers, while the run keeps saving and its retention keeps deleting.

    python examples/evaluation_job.py RUN/checkpoint OUT --model llama3 --flavor debugmodel

By default it follows the run (`dcpkit.follow`): every step the run publishes, in order, none
twice, each held until it is exported, so retention never deletes one first; it ends when the
run does. `--latest` evaluates the newest step instead, again and again (`dcpkit.reading` with
step="latest" chooses and holds it in one operation), skipping those it did already. Each
evaluation is one JSON line on stdout; the exports are OUT/step-N.
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import dcpkit
from dcpkit.convert.hf import to_hf
from dcpkit.readers import run_state
from dcpkit.storage import open_store
from dcpkit.tools.verify import verify_path

parser = argparse.ArgumentParser()
parser.add_argument("run", help="the run's checkpoint folder (or its run folder), path or URL")
parser.add_argument("out", help="a folder for the exports, one step-N per step")
parser.add_argument("--model", default="llama3")
parser.add_argument("--flavor", default="debugmodel")
parser.add_argument("--latest", action="store_true", help="evaluate the newest step, repeatedly")
parser.add_argument("--batches", type=int, default=8, help="evaluation batches per step")
args = parser.parse_args()
torch.set_num_threads(1)  # an evaluation job beside training takes what training leaves
data = torch.randint(0, 256, (args.batches, 2, 64), generator=torch.Generator().manual_seed(0))


def evaluate(held: dcpkit.readers.Reading) -> None:
    start = time.perf_counter()
    report = verify_path(held.location, checksums=True)  # the step, held while checked
    out = Path(args.out) / held.name
    to_hf(held.location, out, args.model, args.flavor, force=True)
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
    while not open_store(args.run).published_steps():  # started before the run's first save
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
