"""What the benchmarks share: each rank's result gathered and printed by rank 0 as one ``RESULT``
line, the launcher that runs a script under torchrun and reads that line back, `forked`, which
runs one measurement in a child of a process that imported torch once, and the results file
a benchmark writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PREFIX = "RESULT "


def model_options(doc: str, dim: int, layers: int, vocab: int) -> Any:
    """An argument parser described by ``doc``'s first paragraph, with the options of a small
    Llama's shape (``--dim``, ``--layers``, ``--vocab``, these defaults) and ``--json``."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=dim)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--json", default="", help="write the results file here")
    return p


def llama_config(opts: Any) -> Any:
    """The ``transformers`` Llama config of ``model_options``' shape (64 positions, heads of 64)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=opts.vocab, hidden_size=opts.dim, intermediate_size=opts.dim * 8 // 3,
        num_hidden_layers=opts.layers, num_attention_heads=opts.dim // 64,
        num_key_value_heads=opts.dim // 64, max_position_embeddings=64,
    )  # fmt: skip


def write_results(opts: Any, keys: tuple[str, ...], results: Any) -> None:
    """With ``--json PATH`` (``opts.json``): the command line, the options named by ``keys``
    and ``results``, written to PATH as the results file the docs' figures come from."""
    if not opts.json:
        return
    from pathlib import Path

    script = Path(sys.argv[0]).name
    record = {
        "command": f"python benchmarks/{script} " + " ".join(sys.argv[1:]),
        "options": {k: getattr(opts, k) for k in keys},
        "results": results,
    }
    Path(opts.json).write_text(json.dumps(record, indent=2) + "\n")


def report(result: Any) -> None:
    """Inside a torchrun job: gather every rank's ``result``; rank 0 prints them as one line."""
    import torch.distributed as td

    gathered: list[Any] = [None] * td.get_world_size()
    td.all_gather_object(gathered, result)
    if td.get_rank() == 0:
        print(PREFIX + json.dumps(gathered), flush=True)


def read_result(stdout: str) -> Any | None:
    """The value a job printed on its ``RESULT`` line, or None."""
    line = next((x for x in stdout.splitlines() if x.startswith(PREFIX)), None)
    return None if line is None else json.loads(line[len(PREFIX) :])


def forked(work: Callable[[], Any], what: str) -> Any | None:
    """``work()`` in a child forked from this process (its memory and time its own, torch already
    imported); its JSON-able result, or None when it failed (its traceback on stderr, and a line
    naming ``what``). Safe only while this process has run no torch operation: a fork copies the
    state of thread pools that a child cannot use."""
    sys.stdout.flush()
    sys.stderr.flush()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        status = 1
        try:
            data = json.dumps(work()).encode()
            with os.fdopen(write_end, "wb") as sink:
                sink.write(data)
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as source:
        data = source.read()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0 or not data:
        print(f"{what} failed (status {code})", file=sys.stderr)
        return None
    return json.loads(data)


@dataclass
class Job:
    ranks: list[dict] | None
    """Each rank's result, or None when the job reported none."""
    returncode: int
    tail: str
    """The end of its output, to show when it failed."""


def run_ranks(script: str, nproc: int, args: list[str], env: dict[str, str] | None = None) -> Job:
    """``script args`` under torchrun with ``nproc`` ranks on this machine (one thread per
    rank for torch's own ops, torchrun's logging quiet)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", script, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR", **(env or {})}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True)
    tail = proc.stdout[-4000:] + "\n" + proc.stderr[-4000:]
    return Job(read_result(proc.stdout), proc.returncode, tail)
