"""Reinforcement learning with a running vLLM engine: the trainer takes a policy-gradient step
on rollouts the engine generated, then pushes its new weights into the engine (dcpkit.push),
which generates the next rollouts with them, without a restart.

    torchrun --nproc-per-node 2 examples/rl_loop.py http://127.0.0.1:8000 OUT [--steps 8]

The engine: a vLLM server (its CPU build, in its own environment: `make vllm-env`) started on
the Hugging Face export of the model's first weights, with the weight-update endpoints and
dcpkit's transport:

    VLLM_SERVER_DEV_MODE=1 .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server \\
        --model INITIAL_HF --served-model-name m --weight-transfer-config \\
        '{"backend": "dcpkit_gloo"}' --dtype float32 --enforce-eager

The model: dcpkit's Llama 3 ``debugmodel_h32`` under FSDP2 on every rank. Its first weights are
``torch.manual_seed(SEED)``'s, written as OUT/initial-hf by ``--write-initial`` (one process,
before the server starts). The task is a toy one, with a reward a person can check: the share
of a completion's tokens whose id is below ``BELOW`` (64 of the 512: an eighth at the start).
Each step: rank 0 asks the engine for ``--samples`` completions of each prompt (temperature 1,
token ids in and out), every rank scores them and takes a REINFORCE step (the reward less its
mean, times the completion's log-probability under the trainer's model), then every rank pushes
(rank 0 sends). One JSON line per step on rank 0: the mean reward, the seconds the engine
generated and the seconds the push took; OUT/rl.json holds them all (the docs' table comes from
such a file).
"""

import argparse
import dataclasses
import json
import sys
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as torch_dist

from dcpkit.models.llama3 import LLAMA3_FLAVORS, Llama3

ARGS = dataclasses.replace(LLAMA3_FLAVORS["debugmodel_h32"], max_seq_len=256)
SEED, BELOW = 0, 64  # the reward: the share of a completion's tokens whose id is below 64
PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [300, 11, 200], [5, 6]]


def write_initial(out: Path) -> None:
    """The model's first weights as a Hugging Face folder (out/initial-hf) the engine starts on,
    with a tokenizer trained on the reference trainer's corpus."""
    import torch.distributed.checkpoint as dcp

    from dcpkit.convert.hf import to_hf
    from dcpkit.train.data import corpus_files, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(corpus_files(max_bytes=200_000), ARGS.vocab_size).save(
        str(out / "tokenizer.json")
    )
    torch.manual_seed(SEED)
    dcp.save({"model": Llama3(ARGS).state_dict()}, checkpoint_id=str(out / "initial"), no_dist=True)
    to_hf(out / "initial", out / "initial-hf", family="llama3", flavor=ARGS,
          tokenizer=str(out / "tokenizer.json"))  # fmt: skip


def rollouts(url: str, samples: int, seed: int) -> list[list[int]]:
    """``samples`` completions of each prompt, as token ids (the engine samples them)."""
    body = {"model": "m", "prompt": PROMPTS, "max_tokens": 12, "temperature": 1.0, "n": samples,
            "seed": seed, "return_tokens_as_token_ids": True, "logprobs": 0}  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
    ordered = sorted(answer["choices"], key=lambda c: c["index"])
    return [[int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]] for c in ordered]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("engine", nargs="?", help="the vLLM server's URL, http://HOST:PORT")
    p.add_argument("out", help="a folder for the run (and, with --write-initial, its start)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--samples", type=int, default=8, help="completions per prompt per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--write-initial", action="store_true", help="write OUT/initial-hf, then stop")
    opts = p.parse_args()
    out = Path(opts.out)
    if opts.write_initial:
        return write_initial(out)
    from torch.distributed.fsdp import fully_shard

    from dcpkit.push import WeightPusher

    torch_dist.init_process_group("gloo")
    rank = torch_dist.get_rank()
    torch.manual_seed(SEED)  # the weights the engine started on
    model = Llama3(ARGS)
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=opts.lr)
    pusher = WeightPusher(opts.engine if rank == 0 else None, family="llama3", args=ARGS)
    lengths = [len(q) for q in PROMPTS for _ in range(opts.samples)]
    prompts = [q for q in PROMPTS for _ in range(opts.samples)]
    records = []
    for step in range(1, opts.steps + 1):
        began = time.perf_counter()
        said = [rollouts(opts.engine, opts.samples, step) if rank == 0 else None]
        generate_s = time.perf_counter() - began
        torch_dist.broadcast_object_list(said, src=0)  # the trainer's own ranks: token ids
        completions = said[0]
        reward = torch.tensor([sum(t < BELOW for t in c) / max(len(c), 1) for c in completions])
        advantage = reward - reward.mean()
        width = max(a + len(c) for a, c in zip(lengths, completions))
        tokens = torch.zeros(len(completions), width, dtype=torch.long)
        mask = torch.zeros(len(completions), width - 1)
        for i, (q, c) in enumerate(zip(prompts, completions)):
            tokens[i, : len(q) + len(c)] = torch.tensor(q + c)
            mask[i, len(q) - 1 : len(q) + len(c) - 1] = 1  # the positions that predict c
        logp = torch.log_softmax(model(tokens[:, :-1]), dim=-1)
        taken = logp.gather(-1, tokens[:, 1:, None])[..., 0] * mask
        loss = -(advantage[:, None] * taken).sum() / mask.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        pushed = pusher.push(model, version=step)  # every rank: the engine serves it next
        if rank == 0:
            record = {"step": step, "reward": round(reward.mean().item(), 4),
                      "generate_s": round(generate_s, 3), "push_s": round(pushed.seconds, 3),
                      "push_mb": round(pushed.bytes / 1e6, 1)}  # fmt: skip
            records.append(record)
            print(json.dumps(record), flush=True)
            run = {"command": "torchrun --nproc-per-node 2 examples/rl_loop.py " +
                   " ".join(sys.argv[1:]), "options": vars(opts), "results": records}  # fmt: skip
            (out / "rl.json").write_text(json.dumps(run, indent=1) + "\n")
    torch_dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
