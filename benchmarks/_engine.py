"""A vLLM server on loopback, started from the engine's own environment (``make vllm-env``),
for the weight-push tests and benchmark: its OpenAI-compatible API, the weight-update endpoints
(``VLLM_SERVER_DEV_MODE=1``) and dcpkit's transport (``dcpkit_gloo``)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def engine_env(**extra: str) -> dict[str, str]:
    """The engine's environment: a 1 GiB KV cache (vLLM would take most of the memory), none of
    a launcher's rank variables."""
    env = dict(os.environ)
    env.update(VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra)
    return env


class VllmServer:
    """``vllm.entrypoints.openai.api_server`` on 127.0.0.1 serving ``model`` as ``m``, in a
    session of its own (``kill`` stops the server and its engine processes together). A start is
    three Pythons that each import vLLM: the server, its engine core and the engine's worker
    (vLLM's CPU platform runs the worker in a process of its own whatever the executor asked
    for, and its server has no in-process engine core)."""

    def __init__(
        self, model: Path, log: Path, dtype: str = "float32", tokenizer: bool = True
    ) -> None:
        self.model, self.log, self.dtype, self.proc = model, log, dtype, None
        self.tokenizer = tokenizer  # False: a folder with none (token ids in, token ids out)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240.0) -> float:
        """Start it and wait for its "startup complete" line; returns the seconds that took."""
        if not VLLM_PYTHON.exists():
            raise RuntimeError(f"{VLLM_PYTHON} is missing: `make vllm-env` builds it")
        cmd = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(self.model), "--served-model-name", "m", "--dtype", self.dtype,
               "--enforce-eager", "--max-model-len", "256", "--host", "127.0.0.1",
               "--port", str(self.port),
               "--weight-transfer-config", '{"backend": "dcpkit_gloo"}']  # fmt: skip
        cmd += [] if self.tokenizer else ["--skip-tokenizer-init"]
        began = time.perf_counter()
        self.proc = subprocess.Popen(cmd, env=engine_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        sink = open(self.log, "ab")  # noqa: SIM115 (closed by the copying thread)
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout  # bounds a hang; the wait is on the log line
        try:
            while True:
                if not selector.select(max(0.0, deadline - time.monotonic())):
                    self.kill()
                    raise RuntimeError(f"the vLLM server did not start in {timeout:.0f} s: "
                                       f"{self.log}")  # fmt: skip
                line = self.proc.stdout.readline()
                sink.write(line)
                if not line:
                    sink.close()
                    raise RuntimeError(f"the vLLM server exited at start: see {self.log}")
                if b"Application startup complete" in line:
                    break
        finally:
            selector.close()
        threading.Thread(target=self._copy, args=(self.proc.stdout, sink), daemon=True).start()
        while True:  # the line comes before the socket listens: until a connection is taken
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
                return time.perf_counter() - began
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.kill()
                    raise RuntimeError(f"the vLLM server never listened: {self.log}") from None
                time.sleep(0.05)

    @staticmethod
    def _copy(source, sink) -> None:
        with sink:
            for line in source:
                sink.write(line)

    def rss(self) -> int:
        """Resident bytes of the server's processes (the API server and its engine)."""
        total = 0
        for pid in _session(self.proc.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            total += next(int(x.split()[1]) * 1024 for x in status.splitlines()
                          if x.startswith("VmRSS:"))  # fmt: skip
        return total

    def reload(self, folder: Path, timeout: float = 1800.0) -> None:
        """vLLM's ``reload_weights`` from ``folder`` (a Hugging Face folder) in this server,
        through its ``/collective_rpc``: a path reload."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        request = urllib.request.Request(self.url + "/collective_rpc", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        urllib.request.urlopen(request, timeout=timeout).read()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=60)


def _session(sid: int) -> list[int]:
    """The processes of session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
