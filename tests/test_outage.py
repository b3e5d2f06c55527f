"""An object store that stops answering in the middle of a save: the save retries with
backoff, then stops naming the endpoint and the step (the previous step stays the latest); a
store that comes back within the retry time lets the save complete."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import subprocess
import threading
import time
import uuid

import pytest
import torch

from conftest import BUCKET, use_endpoint
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager
from dcpkit.storage import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Proxy:
    """A TCP proxy on loopback in front of the S3 server; ``down()`` cuts every connection and
    refuses new ones, as a server that went away; ``up()`` brings it back."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.serving = threading.Event()
        self.serving.set()
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.stopped:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.serving.is_set():
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
        except OSError:
            pass
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.close()

    def down(self) -> None:
        self.serving.clear()
        with self.lock:
            for s in self.open:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
            self.open.clear()

    def up(self) -> None:
        self.serving.set()

    def close(self) -> None:
        self.stopped = True
        self.listener.close()
        self.down()


@pytest.fixture(params=["moto", "seaweedfs"])
def proxy(request, monkeypatch):
    """The proxy in front of S3 on moto (a mock) or on SeaweedFS (a real object store)."""
    import os

    import s3fs

    if request.param == "moto":
        request.getfixturevalue("s3")
    else:
        use_endpoint(monkeypatch, request.getfixturevalue("seaweedfs"))
    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    p = Proxy(port)
    yield p
    p.close()
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def managers(proxy):
    """Every manager a test opens, closed while the proxy is up (a lease-renewal thread left
    running would keep calling a stopped endpoint after the test)."""
    opened: list[CheckpointManager] = []
    yield opened
    proxy.up()
    for mgr in opened:
        mgr.close()


def _manager(proxy, managers, retry_s: float):
    torch.manual_seed(0)
    folder = f"s3://{BUCKET}/outage-{uuid.uuid4().hex}/checkpoint"
    cfg = CheckpointConfig(
        enable=True,
        folder=folder,
        interval=1,
        keep_latest_k=0,
        storage_retry_s=retry_s,
        storage_options={
            "endpoint_url": f"http://127.0.0.1:{proxy.port}",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
        },
    )
    mgr = CheckpointManager(cfg, ".", torch.nn.Linear(64, 64))
    managers.append(mgr)
    return mgr, folder


def test_a_store_that_stays_down_fails_naming_endpoint_and_step(proxy, managers):
    mgr, folder = _manager(proxy, managers, retry_s=6)
    mgr.save(1)
    proxy.down()
    start = time.monotonic()
    with pytest.raises(CheckpointError) as failure:
        mgr.save(2)
    waited = time.monotonic() - start
    text = str(failure.value)
    assert f"saving step 2 into {folder} failed" in text, text
    assert f"127.0.0.1:{proxy.port}" in text and "does not answer" in text
    assert "Step 1 is still the latest" in text and "retried for 6s" in text
    assert waited >= 3, waited  # it did retry, with backoff
    proxy.up()
    assert open_store(folder).published_steps() == [1]


def test_a_store_that_comes_back_lets_the_save_complete(proxy, managers):
    mgr, folder = _manager(proxy, managers, retry_s=60)
    mgr.save(1)
    proxy.down()
    threading.Timer(4.0, proxy.up).start()
    assert mgr.save(2)
    assert open_store(folder).published_steps() == [1, 2]


# --- a load that loses its store, on 2 ranks ----------------------------------------------------


def _torchrun(script_args: list[str], env: dict[str, str]) -> subprocess.Popen:
    import sys

    from conftest import ROOT, torchrun_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(ROOT / "tests" / "scripts" / "load_outage.py"), *script_args]
    return subprocess.Popen(
        cmd, env=torchrun_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _lines(proc: subprocess.Popen, seen: list[str]) -> threading.Thread:
    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line.rstrip("\n"))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def _load_run(folder, endpoint, retry_s, tmp_path, cut=None, back=None):  # type: ignore[no-untyped-def]
    """One 2-rank load; ``cut(proxy)`` is called once the load has started (rank 0's marker),
    ``back`` (seconds after the cut) brings the store back. Returns the ranks' result lines."""
    marker = tmp_path / f"started-{uuid.uuid4().hex}"
    seen: list[str] = []
    proc = _torchrun([folder, endpoint, "load", str(retry_s), str(marker)], {})
    reader = _lines(proc, seen)
    try:
        if cut is not None:
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            cut()
            if back is not None:
                time.sleep(back)
                cut.proxy.up()
        deadline = time.monotonic() + retry_s + 90
        while time.monotonic() < deadline:
            done = [x for x in seen if x.startswith(("FAILED", "STATE"))]
            if len(done) == 2:
                break
            time.sleep(0.1)
        cut.proxy.up() if cut is not None else None
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    assert proc.returncode == 0, "\n".join(seen[-60:])
    return sorted(x for x in seen if x.startswith(("FAILED", "STATE")))


class _Cut:
    def __init__(self, proxy, after: float) -> None:  # type: ignore[no-untyped-def]
        self.proxy, self.after = proxy, after

    def __call__(self) -> None:
        time.sleep(self.after)
        self.proxy.down()


@pytest.fixture
def weed_proxy(seaweedfs, monkeypatch):
    import s3fs

    use_endpoint(monkeypatch, seaweedfs)
    p = Proxy(int(seaweedfs.rsplit(":", 1)[1]))
    yield p
    p.close()
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.dist
def test_a_load_that_loses_its_store_fails_on_every_rank_together(weed_proxy, tmp_path):
    """SeaweedFS behind a proxy cut 0.2 s into a 2-rank load, and at half of it: both ranks
    raise (each catching it and going on to a barrier that both reach) within storage_retry_s
    + 30 s, with the same message naming the store; a store that comes back within the retry
    time lets the load complete bit for bit."""
    endpoint = f"http://127.0.0.1:{weed_proxy.port}"
    folder = f"s3://{BUCKET}/load-outage-{uuid.uuid4().hex}/checkpoint"
    saved = _torchrun([folder, endpoint, "save"], {})
    out, _ = saved.communicate(timeout=300)
    assert saved.returncode == 0, out[-4000:]
    states = sorted(x for x in out.splitlines() if x.startswith("STATE"))
    clean = _load_run(folder, endpoint, 60, tmp_path)
    assert [x.split()[:4] for x in clean] == [x.split()[:4] for x in states], (clean, states)
    took = max(float(x.split()[4]) for x in clean)
    retry_s = 8
    for after in (0.2, took / 2):
        start = time.monotonic()
        lines = _load_run(folder, endpoint, retry_s, tmp_path, cut=_Cut(weed_proxy, after))
        assert time.monotonic() - start < retry_s + 30 + 60  # startup included
        assert [x.split()[:3] for x in lines] == [["FAILED", "rank", "0"], ["FAILED", "rank", "1"]]
        waited = [float(x.split()[3]) for x in lines]
        assert all(w < retry_s + 30 for w in waited), lines
        messages = [x.split(" ", 4)[4] for x in lines]
        assert messages[0] == messages[1], lines
        assert "StoreUnavailable" in messages[0] and f"retried for {retry_s}s" in messages[0]
        assert f"127.0.0.1:{weed_proxy.port}" in messages[0] or BUCKET in messages[0], lines
        weed_proxy.up()
    back = _load_run(folder, endpoint, 60, tmp_path, cut=_Cut(weed_proxy, 0.2), back=3.0)
    assert [x.split()[:4] for x in back] == [x.split()[:4] for x in states], (back, states)


# --- every read a load makes, failing in turn ---------------------------------------------------


def _from_holds() -> bool:
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "dcpkit.storage.holds":
            return True
        frame = frame.f_back
    return False


_LOADS = {
    "load": lambda mgr, folder: mgr.load(),
    "load without verify_on_load": lambda mgr, folder: mgr.load(),
    "load falling back": lambda mgr, folder: mgr.load(),
    "load_from": lambda mgr, folder: mgr.load_from(folder, step="latest"),
    "verify": lambda mgr, folder: mgr.verify(folder, step=1),
}


@pytest.mark.parametrize("case", list(_LOADS))
def test_a_load_whose_store_fails_at_any_read_raises_store_unavailable(tmp_path, monkeypatch, case):
    """The store's Nth read during a load raises ConnectionError (as an object store that stops
    answering does), for every N until the load makes fewer reads: the load raises
    StoreUnavailable each time (the error every rank raises together), never the store's own
    error from a read made outside the ranks' agreement; then it loads, bit for bit. Each way
    in: ``load()`` with and without ``verify_on_load``, one that falls back past a corrupt
    step, ``load_from`` a run's latest step, ``verify``. (The reads of the hold against
    retention are left alone: a load that cannot hold its step reads it without one, see
    test_readers.)"""
    from dcpkit.engine.together import StoreUnavailable
    from dcpkit.storage.local import LocalStore

    folder = tmp_path / "ckpt"
    torch.manual_seed(0)
    cfg = CheckpointConfig(
        enable=True, folder=str(folder), interval=1, storage_retry_s=0, keep_latest_k=0,
        verify_on_load=case != "load without verify_on_load",
        fallback_on_corruption=case == "load falling back",
    )  # fmt: skip
    model = torch.nn.Linear(16, 16)
    saver = CheckpointManager(cfg, ".", model)
    saver.save(1)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    if case == "load falling back":
        with torch.no_grad():
            model.weight.add_(1.0)
        saver.save(2)
        data = folder / "step-2" / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:-8] + bytes(8))
    saver.close()
    calls = {"n": 0, "fail_at": 0}
    for method in ("list_names", "stat", "open_read", "checksum"):
        original = getattr(LocalStore, method)

        def failing(self, *args, _original=original, _method=method, **kwargs):  # type: ignore[no-untyped-def]
            if _from_holds():  # best effort by design: a load goes on without its hold
                return _original(self, *args, **kwargs)
            calls["n"] += 1
            if calls["n"] == calls["fail_at"]:
                raise ConnectionError(f"the store stopped answering ({_method})")
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(LocalStore, method, failing)
    failed_at = []
    for fail_at in range(1, 300):
        torch.manual_seed(1)
        loader = CheckpointManager(cfg, ".", torch.nn.Linear(16, 16))
        calls["n"], calls["fail_at"] = 0, fail_at
        try:
            result = _LOADS[case](loader, str(folder))
        except StoreUnavailable as e:
            assert "retried for 0s" in str(e) and "stopped answering" in str(e), e
            failed_at.append(fail_at)
            continue
        finally:
            made, calls["fail_at"] = calls["n"], 0
            loader.close()
        assert made < fail_at, (case, fail_at, made, result)
        if case == "verify":
            assert result == [], result
        else:
            assert all(torch.equal(saved[k], v) for k, v in loader.model.state_dict().items())
        break
    else:
        pytest.fail("the load never completed")
    assert failed_at == list(range(1, len(failed_at) + 1)) and len(failed_at) >= 5, failed_at
    # Within storage_retry_s, a read that fails once is tried again, and the load completes.
    torch.manual_seed(1)
    loader = CheckpointManager(
        dataclasses.replace(cfg, storage_retry_s=5), ".", torch.nn.Linear(16, 16)
    )
    calls["n"], calls["fail_at"] = 0, failed_at[-1]
    result = _LOADS[case](loader, str(folder))
    loader.close()
    assert calls["n"] > failed_at[-1], calls  # it failed, then read again
    assert result == [] if case == "verify" else result
    if case != "verify":
        assert all(torch.equal(saved[k], v) for k, v in loader.model.state_dict().items())


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["save", "load"])
def test_a_store_failing_on_one_rank_fails_every_rank_together(tmp_path, mode):
    """2 ranks; one rank's Nth storage operation fails (each rank in turn, every N until the
    save or load completes), the other rank's never: both raise the same error, of the kind
    promised (a save's CheckpointError, a load's StoreUnavailable), with the same message; no
    rank raises the store's own error or waits for the other (collectives time out at 60 s).
    The save that completes has published its step (a failure left in its retention only
    defers the deletion to the next save, which makes it); the load restores every shard."""
    import json

    from conftest import run_script

    proc = run_script(2, "store_faults.py", str(tmp_path), mode, "0,1", timeout=240)
    results = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert sorted((r["fail_rank"], r["rank"]) for r in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    expected = "CheckpointError" if mode == "save" else "StoreUnavailable"
    for result in results:
        *failed, last = result["outcomes"]
        for fail_at, outcomes, operation in failed:
            assert [kind for kind, _ in outcomes] == [expected, expected], (fail_at, outcomes)
            assert outcomes[0][1] == outcomes[1][1], (fail_at, outcomes)
            assert operation, (fail_at, outcomes)  # the injected failure is what it reports
        assert last[1] == [["ok", ""], ["ok", ""]], last
        assert len(failed) >= 3, result["outcomes"]
        if mode == "save":
            assert last[2] == "" or " < _retention < " in last[2], last  # never lost silently
            assert result["published"] == [result["last"] - 1, result["last"]], result
        else:
            assert last[2] == "", last
            assert result["loaded"] == result["saved"], result  # this rank's shards
