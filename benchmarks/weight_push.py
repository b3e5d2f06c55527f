"""A trainer's weights into a running vLLM engine (its CPU build, ``make vllm-env``): a push
through ``dcpkit.push`` beside the two ways an engine gets new weights without it, in one run,
per model shape:

- **restart**: write the step as a Hugging Face folder, then start a new server on it;
- **path reload**: write the folder, then the running server's ``reload_weights`` from it
  (vLLM's ``/collective_rpc``);
- **push**: ``WeightPusher.push`` from the trainer's live model, over gloo, in buckets.

    python benchmarks/weight_push.py [--shapes 100M,1B] [--repeats 3] [--bucket-size 256MB]
                                     [--json benchmarks/results/weight_push.json]

Llama 3 shapes in bfloat16 (the engine's dtype): ``100M`` (dim 768, 12 layers, 12 heads of 64,
4 KV heads, vocabulary 32000) and ``1B`` (dcpkit's ``1B`` flavor: Llama 3.2 1B's shape);
``tiny`` (push_fsdp.py's) for the smoke test. The trainer is this process (one rank, one
intra-op thread: vLLM binds its worker to the other core, and a second thread of the trainer's
would wait on it). Each
figure is the median of ``--repeats``; the folder's write (``to_hf`` of the step) is timed once
and counted in both the restart's and the reload's cost, as a trainer that uses them pays it.

The trainer's stall per push: the push itself with ``push``; with ``push_async``, what it
blocks for (its staging copy), beside what a plain copy of the model costs (every parameter
cloned). Peak extra memory: the highest rise of the trainer's and of the server's resident memory
during the pushes over their level before the first push (so it counts what a pusher and the
engine keep from push to push: the trainer's bucket, the engine's copy of the weights),
sampled every 10 ms.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _engine import VllmServer  # this script's folder is on sys.path
from _launch import write_results

SHAPES = {
    "tiny": dict(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=512),
    "100M": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab_size=32000),
    "1B": "1B",
}


def _args(shape: str):
    from dcpkit.models.llama3 import LLAMA3_FLAVORS, Llama3Args

    spec = SHAPES[shape]
    args = LLAMA3_FLAVORS[spec] if isinstance(spec, str) else Llama3Args(**spec)
    return dataclasses.replace(args, max_seq_len=256)


def _rss_self() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))


class Peak:
    """The highest value of ``read()`` above ``base``, sampled every 10 ms while open."""

    def __init__(self, read, base: int) -> None:
        self.read, self.base, self.top = read, base, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.top = max(self.top, self.read() - self.base)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.top = max(self.top, self.read() - self.base)


def one_shape(shape: str, opts: argparse.Namespace, root: Path) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from dcpkit.convert.hf import to_hf
    from dcpkit.models.llama3 import Llama3
    from dcpkit.push import WeightPusher

    torch.set_num_threads(1)  # the engine's worker holds the other core (vLLM binds it)
    args = _args(shape)
    torch.manual_seed(0)
    model = Llama3(args).to(torch.bfloat16)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step, folder = root / "step", root / "hf"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    began = time.perf_counter()
    to_hf(step, folder, family="llama3", flavor=args)
    export_s = time.perf_counter() - began
    staging = []
    for _ in range(opts.repeats):
        began = time.perf_counter()
        copies = [p.detach().clone() for p in model.parameters()]
        staging.append(time.perf_counter() - began)
        del copies
    servers, restarts = [], []
    try:
        for i in range(opts.repeats):  # a restart: a new server on the written folder
            if servers:
                servers.pop().kill()
            servers.append(
                VllmServer(folder, root / f"server-{i}.log", "bfloat16", tokenizer=False)
            )
            restarts.append(servers[-1].start())
        server = servers[-1]
        reloads = []
        for _ in range(opts.repeats):
            began = time.perf_counter()
            server.reload(folder)
            reloads.append(time.perf_counter() - began)
        pusher = WeightPusher(server.url, family="llama3", args=args, bucket_size=opts.bucket_size)
        pushes, swaps, trainer_peak, engine_peak, result = [], [], [], [], None
        mine_before, theirs_before = _rss_self(), server.rss()  # before any push
        for i in range(opts.repeats + 1):  # the first one connects: its time not counted
            with Peak(_rss_self, mine_before) as mine, Peak(server.rss, theirs_before) as theirs:
                began = time.perf_counter()
                result = pusher.push(model, version=i)
                took = time.perf_counter() - began
            trainer_peak.append(mine.top)
            engine_peak.append(theirs.top)
            if i:
                pushes.append(took)
                swaps.append(result.swap_s)
        stalls = []  # push_async: the trainer is blocked for its staging copy
        for i in range(opts.repeats):
            pusher.push_async(model, version=f"async-{i}")
            stalls.append(pusher.wait().stall_s)
    finally:
        for s in servers:
            s.kill()
    push_s = statistics.median(pushes)
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "bytes": nbytes,
        "export_s": export_s,
        "restart_s": statistics.median(restarts),
        "reload_s": statistics.median(reloads),
        "push_s": push_s,
        "push_gb_s": nbytes / push_s / 1e9,
        "swap_s": statistics.median(swaps),
        "staging_s": statistics.median(staging),
        "async_stall_s": statistics.median(stalls),
        "buckets": result.buckets,
        "largest_bucket": result.largest_bucket,
        "largest_tensor": max(p.numel() * p.element_size() for p in model.parameters()),
        "trainer_peak_bytes": max(trainer_peak),
        "engine_peak_bytes": max(engine_peak),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="100M,1B")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-size", default="256MB")
    p.add_argument("--json", default="", help="write the results file here")
    opts = p.parse_args()
    results = {}
    for shape in opts.shapes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"weight-push-{shape}-") as tmp:
            r = results[shape] = one_shape(shape, opts, Path(tmp))
        print(f"{shape}: {r['params'] / 1e6:.0f} M parameters, {r['bytes'] / 1e9:.2f} GB: "
              f"push {r['push_s']:.2f} s ({r['push_gb_s']:.2f} GB/s); restart "
              f"{r['export_s'] + r['restart_s']:.1f} s; path reload "
              f"{r['export_s'] + r['reload_s']:.1f} s; staging copy {r['staging_s']:.2f} s; "
              f"peak extra: trainer {r['trainer_peak_bytes'] / 1e6:.0f} MB, engine "
              f"{r['engine_peak_bytes'] / 1e6:.0f} MB", flush=True)  # fmt: skip
    write_results(opts, ("shapes", "repeats", "bucket_size"), results)


if __name__ == "__main__":
    sys.exit(main())
