"""Weights pushed into a running vLLM engine (its CPU build, in its own environment: ``make
vllm-env``): a 2-rank FSDP2 trainer's Llama after each step, served as a fresh engine started on
the step's Hugging Face export serves it, token for token and logprob for logprob; a trainer
killed mid-push leaves the engine on its previous version; an engine killed mid-push fails the
push on every rank with its name, training goes on, and the restarted engine takes the next.
One server for the module (its start costs ~25 s)."""

from __future__ import annotations

import json
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, Beside, run_ranks, run_script, run_train
from dcpkit.models.llama3 import Llama3

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from push_fsdp import ARGS, served

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BUCKET = 1 << 20  # push_fsdp.py's bucket_size


def _engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


class Server:
    """vLLM's OpenAI-compatible server on 127.0.0.1, started from the vLLM environment in a
    session of its own (killed as a group: the server and its engine process)."""

    def __init__(self, model: Path, log: Path) -> None:
        self.model, self.log, self.proc = model, log, None
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240.0) -> None:
        cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(self.model), "--served-model-name", "m", "--dtype", "float32",
               "--enforce-eager", "--max-model-len", "256", "--host", "127.0.0.1",
               "--distributed-executor-backend", "uni",
               "--port", str(self.port),
               "--weight-transfer-config", '{"backend": "dcpkit_gloo"}']  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=_engine_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        sink = open(self.log, "ab")  # noqa: SIM115 (closed by the copying thread)
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout  # bounds a hang; the wait is on the log line
        while True:
            if not selector.select(max(0.0, deadline - time.monotonic())):
                self.stop()
                pytest.fail(f"the vLLM server did not start in {timeout:.0f} s: {self.log}")
            line = self.proc.stdout.readline()
            sink.write(line)
            if not line:
                pytest.fail(f"the vLLM server exited at start: {self.log.read_text()[-3000:]}")
            if b"Application startup complete" in line:
                break
        selector.close()
        threading.Thread(target=self._copy, args=(self.proc.stdout, sink), daemon=True).start()

    @staticmethod
    def _copy(source, sink) -> None:
        with sink:
            for line in source:
                sink.write(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=60)


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
    server = Server(base / "initial-hf", base / "server.log")
    server.start()
    server.tokenizer = base / "tokenizer.json"
    yield server
    server.stop()


def _run_dir(tmp_path: Path, engine: Server) -> Path:
    shutil.copy(engine.tokenizer, tmp_path / "tokenizer.json")
    return tmp_path


def _fresh(folders: list[Path], out: Path) -> list[dict]:
    """What a fresh engine on each folder answers (tests/scripts/vllm_fresh.py)."""
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "tests" / "scripts" / "vllm_fresh.py"), str(out),
         *map(str, folders)],
        env=_engine_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _exports(run: Path, steps: list[int]) -> list[Path]:
    from dcpkit.convert.hf import to_hf

    for s in steps:
        to_hf(run / "checkpoint" / f"step-{s}", run / f"hf-{s}", tokenizer=run / "tokenizer.json")
    return [run / f"hf-{s}" for s in steps]


def test_a_2_rank_fsdp2_trainer_pushes_each_step_into_a_running_server_exactly(tmp_path, engine):
    run = _run_dir(tmp_path, engine)
    run_script(2, "push_fsdp.py", engine.url, str(run), "3")
    records = json.loads((run / "served.json").read_text())
    assert [r["version"] for r in records] == ["1", "2", "3"]  # each push counted
    largest = max(t.numel() * t.element_size() for t in Llama3(ARGS).state_dict().values())
    for r in records:
        assert r["buckets"] > 1 and r["largest_bucket"] < BUCKET + largest, r
    assert records[0]["outputs"] != records[1]["outputs"] != records[2]["outputs"]
    fresh = _fresh(_exports(run, [1, 2, 3]), tmp_path / "fresh.json")
    for r, f in zip(records, fresh, strict=True):
        assert r["outputs"] == f["outputs"], f"version {r['version']} is not the step's model"


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
    (fresh,) = _fresh(_exports(run, [2]), tmp_path / "fresh.json")
    assert records[0]["outputs"] == fresh["outputs"]


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
