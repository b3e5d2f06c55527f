"""Under torchrun (2 ranks): dcpkit's Llama 3 (head size 32, which vLLM's CPU attention takes)
trained under FSDP2, a step saved after each update (CheckpointManager), and its weights pushed
into a running vLLM server after each save (``WeightPusher``: every rank gathers, rank 0
sends). Rank 0 asks the server for greedy tokens and logprobs of fixed prompts after each push
and writes them, with the version the server says it serves, to OUT/served.json.

    push_fsdp.py ENGINE_URL OUT STEPS [trainer_dies N | engine_dies PID N | async]

``trainer_dies N``: rank 0 exits (os._exit) before the Nth bucket of the last push goes out.
``engine_dies PID N``: rank 0 kills the engine (PID) before the Nth bucket of the first push;
every rank must then get an ``EngineError`` naming the engine, train its next step, and, once
the engine answers again (restarted by the test), push again.
``async``: each step's push is started with ``push_async`` and the next step trains while it
travels; it is waited for (and the server asked) after that step: the engine must serve the
weights as they were when the push started.
"""

import dataclasses
import json
import os
import signal
import sys
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as torch_dist
from torch.distributed.fsdp import fully_shard

from dcpkit import CheckpointConfig, CheckpointManager, HFModel, dist
from dcpkit.models.llama3 import LLAMA3_FLAVORS, Llama3
from dcpkit.push import EngineError, WeightPusher, wire

ARGS = dataclasses.replace(LLAMA3_FLAVORS["debugmodel_h32"], max_seq_len=256)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [300, 11, 200, 42]]


def served(url: str) -> dict:
    """Greedy tokens and top logprobs of PROMPTS, and the version the server serves."""
    body = {
        "model": "m",
        "prompt": PROMPTS,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 3,
        "return_tokens_as_token_ids": True,
    }
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    answer = json.loads(urllib.request.urlopen(req, timeout=120).read())
    with urllib.request.urlopen(url + "/weight_info", timeout=60) as r:
        version = json.loads(r.read())["weight_version"]
    outs = sorted(answer["choices"], key=lambda c: c["index"])
    return {"version": version, "outputs": [[c["logprobs"]["tokens"],
            c["logprobs"]["top_logprobs"]] for c in outs]}  # fmt: skip


def before_bucket(n: int, action) -> None:
    """``action()`` on rank 0 just before its ``n``th bucket goes out (then sent as usual)."""
    real, sent = wire.broadcast, [0]

    def counting(group, buffer):
        sent[0] += 1
        if sent[0] == n:
            action()
        return real(group, buffer)

    wire.broadcast = counting


def wait_for(url: str, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/get_world_size", timeout=5).read()
            return
        except OSError:
            time.sleep(0.5)  # a poll of the restarted server; the deadline only bounds a hang
    raise SystemExit(f"the engine at {url} did not come back in {timeout_s:.0f} s")


def main() -> None:
    url, out, steps = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    fault = sys.argv[4:]
    torch_dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Llama3(ARGS)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = CheckpointConfig(enable=True, folder=str(out / "checkpoint"), interval=1,
                           keep_latest_k=0)  # fmt: skip
    tokenizer = out / "tokenizer.json"
    hf = HFModel("llama3", ARGS, tokenizer=str(tokenizer) if tokenizer.exists() else None)
    mgr = CheckpointManager(cfg, out, model, opt, hf_model=hf)
    pusher = WeightPusher(url if dist.rank() == 0 else None, family="llama3", args=ARGS,
                          bucket_size="1MB")  # fmt: skip
    records: list[dict] = []
    gen = torch.Generator().manual_seed(1)
    step = 0

    def train_step() -> None:
        nonlocal step
        step += 1
        tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mgr.save(step)

    def record(result, pushed: int) -> None:
        if dist.rank() == 0:
            records.append({"step": pushed, "buckets": result.buckets, "bytes": result.bytes,
                            "largest_bucket": result.largest_bucket, "seconds": result.seconds,
                            "stall_s": result.stall_s, **served(url)})  # fmt: skip
            (out / "served.json").write_text(json.dumps(records))

    def push() -> None:
        record(pusher.push(model, version=step), step)

    if fault == ["async"]:
        while step < steps:
            train_step()  # the step before's push travels meanwhile
            if step > 1:
                record(pusher.wait(), step - 1)
            pusher.push_async(model, version=step)
        record(pusher.wait(), step)
        mgr.close()
        torch_dist.destroy_process_group()
        return
    while step < steps:
        train_step()
        if dist.rank() == 0 and fault[:1] == ["trainer_dies"] and step == steps:
            before_bucket(int(fault[1]), lambda: os._exit(9))
        if dist.rank() == 0 and fault[:1] == ["engine_dies"] and step == 1:
            before_bucket(int(fault[2]), lambda: os.killpg(int(fault[1]), signal.SIGKILL))
        if fault[:1] != ["engine_dies"] or step > 1:
            push()
            continue
        try:
            push()
        except EngineError as e:
            (out / f"push_error.{dist.rank()}").write_text(str(e))
        else:
            raise SystemExit("a push into an engine killed mid-push went through")
        train_step()  # training goes on without the engine
        if dist.rank() == 0:
            wait_for(url)
        torch_dist.barrier()
        push()  # the restarted engine is found again
    mgr.close()
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    main()
