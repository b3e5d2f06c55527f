"""Weights pushed into a running vLLM engine (its CPU build, in its own environment: ``make
vllm-env``): a 2-rank FSDP2 trainer's Llama after each step (pushed in the background while the
next step trains), served as a fresh engine started on the step's Hugging Face export serves
it, token for token and logprob for logprob (and a step pushed from its checkpoint into an
engine in the pushing process, the same); a trainer killed mid-push leaves the engine on its
previous version; an engine killed mid-push fails the push on every rank with its name,
training goes on, and the restarted engine takes the next. One server for the module (a start
is three Pythons that each import vLLM; benchmarks/_engine.py)."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from conftest import ROOT, Beside, run_ranks, run_script, run_train
from dcpkit.models.llama3 import Llama3

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from _engine import VLLM_PYTHON, VllmServer, engine_env
from push_fsdp import ARGS, served

BUCKET = 1 << 20  # push_fsdp.py's bucket_size


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A running server, started on the HF export of a Llama of push_fsdp.py's shape (other
    weights than any step's), with a tokenizer trained here."""
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm-env` builds the engine's environment")
    import torch.distributed.checkpoint as dcp

    from dcpkit.convert.hf import to_hf
    from dcpkit.train.data import corpus_files, train_tokenizer

    base = tmp_path_factory.mktemp("engine")
    train_tokenizer(corpus_files(max_bytes=200_000), ARGS.vocab_size).save(
        str(base / "tokenizer.json")
    )
    torch.manual_seed(123)
    dcp.save({"model": Llama3(ARGS).state_dict()}, checkpoint_id=str(base / "initial"),
             no_dist=True)  # fmt: skip
    to_hf(base / "initial", base / "initial-hf", family="llama3", flavor=ARGS,
          tokenizer=str(base / "tokenizer.json"))  # fmt: skip
    server = VllmServer(base / "initial-hf", base / "server.log")
    server.start()
    server.tokenizer = base / "tokenizer.json"
    yield server
    server.kill()


def _run_dir(tmp_path: Path, engine: VllmServer) -> Path:
    shutil.copy(engine.tokenizer, tmp_path / "tokenizer.json")
    return tmp_path


def _fresh(folders: list[Path], out: Path, *push: str) -> list[dict]:
    """What a fresh engine on each folder answers (tests/scripts/vllm_fresh.py; ``push``:
    ``--push STEP``, a step pushed into the first one, in its process)."""
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "scripts" / "vllm_fresh.py"), str(out),
         *map(str, folders), *push],
        env=engine_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _exports(run: Path, steps: list[int]) -> list[Path]:
    from dcpkit.convert.hf import to_hf

    for s in steps:
        to_hf(run / "checkpoint" / f"step-{s}", run / f"hf-{s}", tokenizer=run / "tokenizer.json")
    return [run / f"hf-{s}" for s in steps]


def test_a_2_rank_fsdp2_trainer_pushes_each_step_in_the_background_into_a_server_exactly(
    tmp_path, engine
):
    run = _run_dir(tmp_path, engine)
    run_script(2, "push_fsdp.py", engine.url, str(run), "3", "async")  # the next step trains
    records = json.loads((run / "served.json").read_text())  # while a push travels
    assert [r["version"] for r in records] == ["1", "2", "3"]  # each push counted
    assert all(r["stall_s"] < r["seconds"] for r in records)  # blocked for the copy alone
    largest = max(t.numel() * t.element_size() for t in Llama3(ARGS).state_dict().values())
    for r in records:
        assert r["buckets"] > 1 and r["largest_bucket"] < BUCKET + largest, r
    assert records[0]["outputs"] != records[1]["outputs"] != records[2]["outputs"]
    step3 = str(run / "checkpoint" / "step-3")
    fresh = _fresh(_exports(run, [1, 2, 3]), tmp_path / "fresh.json", "--push", step3)
    pushed = fresh.pop(1)  # step 3 pushed into an in-process engine started on step 1
    for r, f in zip(records, fresh, strict=True):
        assert r["outputs"] == f["outputs"], f"version {r['version']} is not the step's model"
    assert pushed["version"] == "3" and pushed["buckets"] > 1
    assert pushed["outputs"] == fresh[2]["outputs"] != fresh[0]["outputs"]


def test_a_trainer_killed_mid_push_leaves_the_engine_on_its_previous_version(tmp_path, engine):
    run = _run_dir(tmp_path, engine)
    before = served(engine.url)
    proc = run_ranks(2, ROOT / "tests" / "scripts" / "push_fsdp.py", engine.url, str(run), "1",
                     "trainer_dies", "3", torchrun=True)  # fmt: skip
    assert proc.returncode != 0, "the trainer was to die mid-push"
    assert (run / "checkpoint" / "step-1").is_dir() and not (run / "served.json").exists()
    assert served(engine.url) == before  # the same version, the same answers: never a mix
    (tmp_path / "again").mkdir()
    again = _run_dir(tmp_path / "again", engine)
    run_script(2, "push_fsdp.py", engine.url, str(again), "1")  # the session left open ends
    record = json.loads((again / "served.json").read_text())[0]
    assert record["version"] == "1" and record["outputs"] != before["outputs"]


def test_an_engine_killed_mid_push_fails_every_rank_by_its_name_and_the_next_push_goes_through(
    tmp_path, engine
):
    run = _run_dir(tmp_path, engine)
    script = ROOT / "tests" / "scripts" / "push_fsdp.py"
    with Beside(run_ranks, 2, script, engine.url, str(run), "2", "engine_dies",
                str(engine.proc.pid), "3") as job:  # fmt: skip
        engine.proc.wait(timeout=300)  # killed by the trainer's rank 0, mid-push
        engine.start()
        proc = job.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        said = (run / f"push_error.{rank}").read_text()
        assert engine.url in said, said
    records = json.loads((run / "served.json").read_text())
    assert [r["version"] for r in records] == ["2"]  # step 2 trained without the engine
    # the restarted engine serves step 2 exactly: as it does after loading step 2's export from
    # its path (the first test compares pushes with fresh engines on the exports)
    (hf,) = _exports(run, [2])
    engine.reload(hf, timeout=300)
    assert served(engine.url)["outputs"] == records[0]["outputs"]


def test_push_follow_beside_a_run_pushes_every_step_once_in_order(tmp_path, engine, capsys, caplog):
    from dcpkit.cli import main

    dump = tmp_path / "run"
    waiting = threading.Event()

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for a run to save into" in record.getMessage():
                waiting.set()

    said = Said()
    logging.getLogger("dcpkit").addHandler(said)
    caplog.set_level(logging.INFO, logger="dcpkit")
    follow = ["push", str(dump), engine.url, "--follow", "--poll", "0.2", "--wait", "150"]
    try:
        with Beside(main, follow) as follower:
            assert waiting.wait(120), "the follower did not start"  # it holds from the start
            run_train(2, dump, "--model.flavor", "debugmodel_h32", "--training.steps", "6",
                      "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "2")  # fmt: skip
            assert follower.result() == 0
    finally:
        logging.getLogger("dcpkit").removeHandler(said)
    printed = capsys.readouterr().out
    pushed = re.findall(r"^push: (\S+) -> \S+: version (\d+),", printed, re.MULTILINE)
    assert pushed == [(f"step-{s}", str(s)) for s in range(1, 7)], printed
    assert "6 step(s) pushed" in printed
    assert sorted(p.name for p in (dump / "checkpoint").glob("step-*")) == ["step-5", "step-6"]
    assert served(engine.url)["version"] == "6"


def test_the_rl_example_pushes_after_every_step_and_the_engine_serves_each(tmp_path, engine):
    """examples/rl_loop.py on 2 ranks against the module's server: rollouts from the engine,
    a policy-gradient step, a push, 3 times; the engine serves the last step's version."""
    proc = run_ranks(2, ROOT / "examples" / "rl_loop.py", engine.url, str(tmp_path), "--steps",
                     "3", "--samples", "2")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads((tmp_path / "rl.json").read_text())
    assert [r["step"] for r in run["results"]] == [1, 2, 3]
    assert all(r["push_s"] > 0 and r["generate_s"] > 0 and 0 <= r["reward"] <= 1
               for r in run["results"])  # fmt: skip
    assert served(engine.url)["version"] == "3"


def test_the_weight_push_benchmark_small_and_its_docs_table(tmp_path):
    """benchmarks/weight_push.py at its smallest (a tiny Llama, one repeat): a push, a restart
    and a path reload measured in one run; the push beats a restart; the engine page's table is
    the committed results file's."""
    out = tmp_path / "push.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "weight_push.py"), "--shapes", "tiny",
           "--repeats", "1", "--bucket-size", "1MB", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())["results"]["tiny"]
    assert r["buckets"] > 1 and r["largest_bucket"] <= max(2**20, r["largest_tensor"])
    assert r["push_s"] < r["restart_s"]
    committed = json.loads((ROOT / "benchmarks" / "results" / "weight_push.json").read_text())
    page = (ROOT / "docs" / "engines.md").read_text()
    for shape in committed["results"]:
        assert f"| {shape} (" in page, shape
