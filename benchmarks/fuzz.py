"""Fuzzing every reader with mutated checkpoints: nothing read from disk may crash, hang, blow
up memory, print a traceback, or load corrupt data as if it were intact.

    python benchmarks/fuzz.py --mutants 3000 --seed 1 --json fuzz.json

Seeds: a small DCP checkpoint written by ``CheckpointManager`` (model, optimizer, a user state,
RNG), its Hugging Face export and its ``torch.save`` conversion. Each mutant changes one file of
one seed (bytes flipped, truncated, extended, a block swapped, zeroed or duplicated), then goes
through ``inspect``, ``verify``, ``diff``, the conversions and (DCP) a manager ``load()``, in
worker processes with a memory limit and a time limit per call. Outcomes:

- ``ok``: output, or a one-paragraph error and exit 1/2 (the CLI), or a dcpkit error (the API);
- ``traceback``: an exception escaped (what the CLI would print as a traceback);
- ``hang``, ``memory``, ``crash``: a call ran past its limit, ran out of memory, or killed
  the worker;
- ``silent``: a mutant whose bytes differ from its seed verified OK or loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

TINY = {"dim": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128}
MUTATIONS = ("flip", "truncate", "extend", "swap", "zero", "duplicate")
CALL_SECONDS = 30
MEMORY_LIMIT = 8 << 30
BAD = ("traceback", "hang", "memory", "crash", "silent")


# --- seeds ---------------------------------------------------------------------------------------


def _args():  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from dcpkit.models import flavors

    return replace(flavors("llama3")["debugmodel"], max_seq_len=16, **TINY)


class _Counter:
    def __init__(self) -> None:
        self.step = 3

    def state_dict(self):  # type: ignore[no-untyped-def]
        return {"step": self.step, "order": [3, 1, 2]}

    def load_state_dict(self, state):  # type: ignore[no-untyped-def]
        self.step = state["step"]


def _model(seed: int):  # type: ignore[no-untyped-def]
    import torch

    from dcpkit.models import build_model

    torch.manual_seed(seed)
    return build_model("llama3", "debugmodel", max_seq_len=16, **TINY)


def make_seeds(root: Path) -> dict[str, Path]:
    import torch

    from dcpkit import CheckpointConfig, CheckpointManager
    from dcpkit.convert.hf import to_hf
    from dcpkit.convert.torch_save import to_torch

    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    opt.step()
    cfg = CheckpointConfig(enable=True, interval=1)
    with CheckpointManager(cfg, root, model, opt, states={"data": _Counter()}) as mgr:
        mgr.save(1)
    dcp_seed = root / "checkpoint" / "step-1"
    to_hf(dcp_seed, root / "hf", "llama3", _args())
    to_torch(dcp_seed, root / "model.pth")
    return {"dcp": dcp_seed, "hf": root / "hf", "pth": root / "model.pth"}


# --- mutants -------------------------------------------------------------------------------------


def mutate(data: bytes, rng: random.Random) -> tuple[str, bytes]:
    kind = rng.choice(MUTATIONS)
    b = bytearray(data)
    n = len(b)
    if kind == "flip" and n:
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(n)] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        b = b[: rng.randrange(n + 1)] if n else b
    elif kind == "extend":
        b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4096)))
    elif kind == "swap" and n > 2:
        size = rng.randint(1, max(1, n // 4))
        i, j = rng.randrange(n - size + 1), rng.randrange(n - size + 1)
        b[i : i + size], b[j : j + size] = b[j : j + size], b[i : i + size]
    elif kind == "zero" and n:
        i = rng.randrange(n)
        size = rng.randint(1, n - i)
        b[i : i + size] = bytes(size)
    elif kind == "duplicate" and n:
        i = rng.randrange(n)
        size = rng.randint(1, min(4096, n - i))
        b[i:i] = b[i : i + size]
    return kind, bytes(b)


def make_mutants(seeds: dict[str, Path], root: Path, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    kinds = list(seeds)
    mutants = []
    while len(mutants) < count:
        kind = kinds[len(mutants) % len(kinds)]
        src = seeds[kind]
        files = sorted(p for p in src.iterdir() if p.is_file()) if src.is_dir() else [src]
        target = rng.choice(files)
        how, data = mutate(target.read_bytes(), rng)
        if data == target.read_bytes() or _same_json(target, data):
            continue  # not a corruption: the same bytes, or the same JSON spelled otherwise
        dest = root / f"m{len(mutants):05d}"
        dest.mkdir(parents=True)
        path = dest / src.name
        if src.is_dir():
            shutil.copytree(src, path)
            (path / target.name).write_bytes(data)
        else:
            path.write_bytes(data)
        mutants.append(
            {"id": len(mutants), "kind": kind, "file": target.name, "how": how, "path": str(path)}
        )
    return mutants


def _same_json(target: Path, data: bytes) -> bool:
    if target.suffix != ".json":
        return False

    def strict(pairs):  # type: ignore[no-untyped-def]
        keys = [k for k, _ in pairs]
        if len(keys) != len(set(keys)):
            raise ValueError("duplicate key")
        return dict(pairs)

    try:
        return json.loads(data, object_pairs_hook=strict) == json.loads(target.read_bytes())
    except ValueError:
        return False


# --- the worker: every entry point on each mutant ------------------------------------------------


class _Timeout(BaseException):
    pass


def _on_alarm(signum, frame):  # type: ignore[no-untyped-def]
    raise _Timeout


def _cli(argv: list[str]) -> tuple[str, int]:
    from dcpkit.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(argv)
    if "Traceback" in err.getvalue() or (code == 2 and not err.getvalue().strip()):
        return "traceback", code
    return "ok", code


def _call(fn) -> tuple[str, object]:  # type: ignore[no-untyped-def]
    signal.alarm(CALL_SECONDS)
    try:
        return fn()
    except _Timeout:
        return "hang", None
    except MemoryError:
        return "memory", None
    except BaseException as e:  # what escaped is the finding
        return "traceback", f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        signal.alarm(0)


def run_mutant(m: dict, seeds: dict[str, str], scratch: Path) -> dict[str, object]:
    from dcpkit import CheckpointError, ConfigError
    from dcpkit.convert.hf import to_hf

    path, kind, seed = m["path"], m["kind"], seeds[m["kind"]]
    out = scratch / f"out{m['id']}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    results: dict[str, object] = {}
    results["inspect"] = _call(lambda: _cli(["inspect", path]))
    verdict, code = _call(lambda: _cli(["verify", path]))
    # A mutant of a checkpoint with a manifest (or a zip's CRCs) must not verify.
    if verdict == "ok" and code == 0 and kind in ("dcp", "hf"):
        verdict = "silent"
    results["verify"] = (verdict, code)
    results["diff"] = _call(lambda: _cli(["diff", seed, path]))
    if kind == "dcp":
        results["to-torch"] = _call(lambda: _cli(["to-torch", path, str(out / "m.pth")]))

        def export():  # type: ignore[no-untyped-def]
            try:
                to_hf(path, out / "hf", "llama3", _args())
            except (ValueError, OSError, RuntimeError, CheckpointError) as e:
                return "ok", type(e).__name__
            return "ok", 0

        results["to-hf"] = _call(export)

        def load():  # type: ignore[no-untyped-def]
            from dcpkit import CheckpointConfig, CheckpointManager

            cfg = CheckpointConfig(enable=True, folder=str(Path(path).parent), load_only=True)
            mgr = CheckpointManager(cfg, ".", _model(1), states={"data": _Counter()})
            try:
                mgr.load()
            except (CheckpointError, ConfigError) as e:
                return "ok", type(e).__name__
            return "silent", "loaded"

        results["load"] = _call(load)
    elif kind == "hf":
        results["from-hf"] = _call(lambda: _cli(["from-hf", path, str(out / "dcp")]))
    else:
        results["from-torch"] = _call(lambda: _cli(["from-torch", path, str(out / "dcp")]))
    shutil.rmtree(out, ignore_errors=True)
    return results


def worker(batch_file: str) -> None:
    import resource
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.CRITICAL)
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGALRM, _on_alarm)
    batch = json.loads(Path(batch_file).read_text())
    scratch = Path(batch["scratch"])
    for m in batch["mutants"]:
        res = run_mutant(m, batch["seeds"], scratch)
        print(json.dumps({"id": m["id"], "results": res}), flush=True)


# --- the driver ----------------------------------------------------------------------------------


def run(count: int, seed: int, workdir: Path, workers: int = 2) -> dict:
    from dcpkit.progress import progress

    start = time.perf_counter()
    seeds = make_seeds(workdir / "seeds")
    mutants = make_mutants(seeds, workdir / "mutants", count, seed)
    pending = {m["id"]: m for m in mutants}
    outcomes: dict[int, dict] = {}
    bar = progress(len(mutants), "fuzz", unit="mutant")
    while pending:
        ids = sorted(pending)
        chunks = [ids[i::workers] for i in range(workers)]
        procs = []
        for n, chunk in enumerate(c for c in chunks if c):
            batch = workdir / f"batch{n}.json"
            batch.write_text(
                json.dumps(
                    {
                        "mutants": [pending[i] for i in chunk],
                        "seeds": {k: str(v) for k, v in seeds.items()},
                        "scratch": str(workdir / f"scratch{n}"),
                    }
                )
            )
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, __file__, "--worker", str(batch)]
            procs.append((chunk, subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)))
        lines: dict[int, list[str]] = {}

        def drain(n: int, proc: subprocess.Popen, out: dict[int, list[str]]) -> None:
            for line in proc.stdout:
                out.setdefault(n, []).append(line)
                bar.update(1)
            proc.wait()

        readers = [
            threading.Thread(target=drain, args=(n, proc, lines))
            for n, (_, proc) in enumerate(procs)
        ]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        for n, (chunk, proc) in enumerate(procs):
            done = set()
            for line in lines.get(n, []):
                rec = json.loads(line)
                outcomes[rec["id"]] = rec["results"]
                done.add(rec["id"])
            for i in chunk:
                pending.pop(i, None) if i in done else None
            if proc.returncode != 0:  # the first unfinished mutant killed the worker
                crashed = next(i for i in chunk if i not in done)
                outcomes[crashed] = {"worker": ["crash", proc.returncode]}
                pending.pop(crashed)
    bar.close()
    tally: Counter = Counter()
    findings = []
    for i, res in sorted(outcomes.items()):
        for entry, (verdict, detail) in res.items():
            tally[(entry, verdict)] += 1
            if verdict in BAD:
                findings.append(
                    {
                        **pending.get(i, mutants[i]),
                        "entry": entry,
                        "verdict": verdict,
                        "detail": detail,
                    }
                )
    return {
        "mutants": len(mutants),
        "seed": seed,
        "by_format": dict(Counter(m["kind"] for m in mutants)),
        "by_mutation": dict(Counter(m["how"] for m in mutants)),
        "calls": sum(tally.values()),
        "outcomes": {f"{e} {v}": n for (e, v), n in sorted(tally.items())},
        "findings": findings,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mutants", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--workdir", help="keep the seeds and mutants here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dcpkit-fuzz-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        report = run(args.mutants, args.seed, work, args.workers)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(
        f"{report['mutants']} mutants ({report['by_format']}), {report['calls']} calls in "
        f"{report['seconds']}s: {len(report['findings'])} findings"
    )
    for key, n in report["outcomes"].items():
        print(f"  {key:<22} {n}")
    for f in report["findings"][:20]:
        print(
            f"  FINDING {f['verdict']}: {f['entry']} on {f['kind']} {f['file']} ({f['how']}): "
            f"{f['detail']}"
        )
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
