"""An object store that stops answering in the middle of a save: the save retries with
backoff, then stops naming the endpoint and the step (the previous step stays the latest); a
store that comes back within the retry time lets the save complete."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from conftest import BUCKET, Beside, run_script, use_endpoint
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
        self.forwarded = 0  # bytes the server sent to clients since count()
        self.cut_at: int | None = None
        self.back: float | None = None
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def count(self, cut_at: int | None = None, back: float | None = None) -> None:
        """Count the server's bytes from zero; with ``cut_at``, go ``down()`` once that many
        have passed (a cut at a point of the transfer, whatever the machine's speed), and
        ``up()`` again ``back`` seconds later if given."""
        with self.lock:
            self.forwarded, self.cut_at, self.back, self.cuts = 0, cut_at, back, 0

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
                threading.Thread(target=self._pipe, args=(a, b, a is server), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, from_server: bool) -> None:
        try:
            while data := a.recv(1 << 16):
                b.sendall(data)
                if from_server:
                    with self.lock:
                        self.forwarded += len(data)
                        trip = self.cut_at is not None and self.forwarded >= self.cut_at
                        if trip:
                            self.cut_at, self.cuts = None, self.cuts + 1
                    if trip:
                        self.down()
                        if self.back is not None:
                            threading.Timer(self.back, self.up).start()
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

    use_endpoint(monkeypatch, request.getfixturevalue(request.param))
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


def _ranks(*script_args: str) -> subprocess.CompletedProcess:
    return run_script(2, "load_outage.py", *script_args, timeout=300)


def _wait_for(paths: list, job: Beside, timeout: float = 120) -> None:
    """Until every file of ``paths`` exists (a rank got there), or the job ended without."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert not job.done(), job.result()
        assert time.monotonic() < deadline, f"none of {paths} within {timeout}s"
        time.sleep(0.005)


def _load_run(folder, endpoint, retry_s, tmp_path, proxy, cut_at=None, back=None):  # type: ignore[no-untyped-def]
    """One 2-rank load through ``proxy``, which goes down once ``cut_at`` bytes of the store's
    answers have passed (counted from the launch) and, with ``back``, comes back that many
    seconds later. Returns the ranks' result lines and the bytes the store sent."""
    marker = tmp_path / f"started-{uuid.uuid4().hex}"
    proxy.count(cut_at, back)
    with Beside(_ranks, folder, endpoint, "load", str(retry_s), str(marker)) as job:
        if cut_at is not None:
            # each rank's result, then the store back for the ranks' close (its lease)
            _wait_for([Path(f"{marker}.{r}") for r in (0, 1)], job, retry_s + 90)
            proxy.up()
        proc = job.result()
    lines = sorted(x for x in proc.stdout.splitlines() if x.startswith(("FAILED", "STATE")))
    return lines, proxy.forwarded


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
    """SeaweedFS behind a proxy cut an eighth into a 2-rank load's bytes, and at half of them
    (points of the transfer, not of the clock, so the cut lands inside the load): both ranks
    raise (each catching it and going on to a barrier that both reach) within storage_retry_s
    + 30 s, with the same message naming the store; a store that comes back within the retry
    time lets the load complete bit for bit."""
    endpoint = f"http://127.0.0.1:{weed_proxy.port}"
    folder = f"s3://{BUCKET}/load-outage-{uuid.uuid4().hex}/checkpoint"
    saved = _ranks(folder, endpoint, "save")
    states = sorted(x for x in saved.stdout.splitlines() if x.startswith("STATE"))
    clean, total = _load_run(folder, endpoint, 60, tmp_path, weed_proxy)
    assert [x.split()[:4] for x in clean] == [x.split()[:4] for x in states], (clean, states)
    retry_s = 4
    for cut_at in (total // 8, total // 2):
        start = time.monotonic()
        lines, _ = _load_run(folder, endpoint, retry_s, tmp_path, weed_proxy, cut_at)
        assert weed_proxy.cuts == 1
        assert time.monotonic() - start < retry_s + 30 + 60  # startup included
        assert [x.split()[:3] for x in lines] == [["FAILED", "rank", "0"], ["FAILED", "rank", "1"]]
        waited = [float(x.split()[3]) for x in lines]
        assert all(w < retry_s + 30 for w in waited), lines
        messages = [x.split(" ", 4)[4] for x in lines]
        assert messages[0] == messages[1], lines
        assert "StoreUnavailable" in messages[0] and f"retried for {retry_s}s" in messages[0]
        assert f"127.0.0.1:{weed_proxy.port}" in messages[0] or BUCKET in messages[0], lines
    back, _ = _load_run(folder, endpoint, 60, tmp_path, weed_proxy, total // 8, back=3.0)
    assert weed_proxy.cuts == 1
    assert [x.split()[:4] for x in back] == [x.split()[:4] for x in states], (back, states)


# --- each storage operation of a save or a load, failing on one rank in turn ---------------------

_WAYS = (
    "save", "save-async", "save-first", "load", "load-unverified", "load-fallback", "load_from",
    "verify",
)  # fmt: skip


@pytest.mark.dist
def test_a_store_failing_on_one_rank_fails_every_rank_together(tmp_path):
    """2 ranks; one rank's Nth storage operation fails with ConnectionError (as an object store
    that stops answering does: each rank in turn, every N until the operation completes), the
    other rank's never. Each way in: a save (its retention included), a background save, a
    manager's first save (it takes the lease), ``load()`` with and without ``verify_on_load``,
    one that falls back past a corrupt step, ``load_from`` a run's ``latest``, ``verify``.
    Every failure is raised on both ranks with the same message, of the kind promised (a
    save's CheckpointError, a background save's AsyncSaveError, which is one, a load's
    StoreUnavailable): never the store's own error from an operation made outside the ranks'
    agreement, never a rank left waiting for the other (collectives time out at 60 s), never a
    lease that could not be read taken for a free folder. The save that completes has
    published its step (a failure left in its retention defers the deletion to the next save,
    which makes it); the load restores every shard bit for bit; and with storage_retry_s the
    last failure is tried again and the operation completes. (Reads of the hold against
    retention are left alone: a load that cannot hold its step reads it without one, see
    test_readers.)"""
    import json

    from conftest import run_script

    args = (str(tmp_path), ",".join(_WAYS), "0,1")
    proc = run_script(2, "store_faults.py", *args, timeout=300)
    results = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    seen = sorted((r["mode"], r["fail_rank"], r["rank"]) for r in results)
    assert seen == sorted((m, f, r) for m in _WAYS for f in (0, 1) for r in (0, 1)), seen
    for result in results:
        where = (result["mode"], "failing on rank", result["fail_rank"])
        saving = result["mode"].startswith("save")
        expected = ("CheckpointError", "AsyncSaveError") if saving else ("StoreUnavailable",)
        *failed, last = result["outcomes"]
        for fail_at, outcomes, operation in failed:
            seen = (where, fail_at, outcomes)
            assert outcomes[0][0] in expected and outcomes[0] == outcomes[1], seen
            assert operation, seen  # the failure made is what it reports
        assert last[1] == [["ok", ""], ["ok", ""]], (where, last)
        assert len(failed) >= 3, (where, result["outcomes"])
        assert result["retried"][0] == ["ok", ""] and result["retried"][1], (where, result)
        if saving:
            assert not last[2] or " < dcpkit.engine.publish._retention < " in last[2], last
            assert result["published"] == [result["last"] - 1, result["last"]], (where, result)
        else:
            assert last[2] == "", (where, last)
        if not saving and result["mode"] != "verify":
            assert result["loaded"] == result["saved"], (where, result)  # this rank's shards
