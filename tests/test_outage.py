"""An object store that stops answering in the middle of a save: the save retries with
backoff, then stops naming the endpoint and the step (the previous step stays the latest); a
store that comes back within the retry time lets the save complete."""

from __future__ import annotations

import contextlib
import socket
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
