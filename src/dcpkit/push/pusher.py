"""A push: the trainer's weights, by the engine's names, into a running inference engine while
it serves, in buckets of bounded size; the engine swaps the whole version in at the end.

Every trainer rank calls ``push`` (its parameters' shards are gathered a tensor at a time, a
collective); rank 0 alone talks to the engine. Extra memory on rank 0: one bucket (kept from
push to push: memory faulted in anew costs more than the copy into it), plus the tensor being
gathered (the largest one bounds it); on other ranks: the tensor being gathered.
An engine that fails mid-push fails ``push`` on every rank with an ``EngineError`` that names
it; training goes on, and the next push connects again (an engine restarted is found)."""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from dcpkit.push import wire
from dcpkit.push.engines import EngineError, HttpEngine, engine_for
from dcpkit.push.sources import model_view, parameters, stage
from dcpkit.units import parse_size

logger = logging.getLogger(__name__)


@dataclass
class PushResult:
    """What one push sent, and how long it took."""

    version: str
    engine: str
    tensors: int
    bytes: int
    buckets: int
    largest_bucket: int
    seconds: float
    swap_s: float = 0.0
    """Of ``seconds``: the engine's swap (pause, the new version loaded, resume)."""
    stall_s: float = 0.0
    """How long the trainer was blocked: ``seconds`` for ``push``, the staging copy for
    ``push_async``."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def local_address(engine: Any) -> str:
    """The address of this machine the engine reaches: loopback for an engine on this machine,
    else the interface that routes to it."""
    host = urlparse(engine.url).hostname if isinstance(engine, HttpEngine) else None
    if host in (None, "localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # no packet is sent: the route is looked up
        return s.getsockname()[0]


class WeightPusher:
    """Pushes weights into one engine: ``engine`` is a vLLM server's URL or a ``vllm.LLM`` (on
    rank 0; other ranks may pass None). ``family``/``args``: how trainer names become the
    engine's (see ``sources.model_view``). ``bucket_size``: the most bytes sent at a time."""

    def __init__(
        self,
        engine: Any,
        *,
        family: str | None = None,
        args: Any = None,
        bucket_size: str | int = "256MB",
        host: str | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.engine = engine_for(engine, timeout_s) if self.rank == 0 else None
        self.family, self.args, self.timeout_s = family, args, timeout_s
        self.bucket_bytes = parse_size(bucket_size)
        self.host = host
        self.group: Any = None
        self.pushes = 0
        self._buffer: torch.Tensor | None = None  # rank 0's bucket, kept from push to push
        self._kept: dict[str, torch.Tensor] = {}  # push_async's copies, kept likewise
        self._group: Any = None  # push_async's own group (and its mesh), made at its first
        self._mesh: Any = None
        self._pending: _Call | None = None

    def push(self, model: Any, version: str | int | None = None) -> PushResult:
        """Send ``model``'s weights (every rank calls it) as ``version`` (default: a count of
        this pusher's pushes); returns once the engine serves them."""
        self.wait()
        return self.push_view(model_view(model, self.family, self.args), version)

    def push_async(self, model: Any, version: str | int | None = None) -> None:
        """Start a push of ``model``'s weights as they are now and return once they are copied
        (every rank copies the shards it holds, into memory kept from push to push): training
        goes on while they travel, gathered over a group of the push's own. The push before
        is waited for first; ``wait()`` waits for this one and gives its result (or raises
        its ``EngineError``)."""
        self.wait()
        began = time.perf_counter()
        if self._mesh is None and self.world > 1:
            from torch.distributed.device_mesh import DeviceMesh

            self._group = dist.new_group(backend="gloo")  # every rank, in the same order
            self._mesh = DeviceMesh.from_group(self._group, "cpu")
        staged = stage(parameters(model), self._kept, self._mesh)
        view = model_view(staged, self.family, self.args)
        stall = time.perf_counter() - began
        self._pending = _Call(self.push_view, view, version, self._group, stall)

    def wait(self) -> PushResult | None:
        """The result of the push ``push_async`` started (None: none is in flight)."""
        pending, self._pending = self._pending, None
        return pending.result(None) if pending is not None else None

    def push_view(
        self, view: Any, version: str | int | None = None, group: Any = None, stall: float = -1
    ) -> PushResult:
        """Send the tensors of ``view`` (``names()``, ``read(name)``: by the engine's names);
        ``group``: the trainer's group the outcome is agreed on (default: the default one)."""
        self.pushes += 1
        version = str(version if version is not None else self.pushes)
        start = time.perf_counter()
        result = PushResult(version, self.engine.name if self.engine else "", 0, 0, 0, 0, 0.0)
        failure: BaseException | None = None
        if self.rank == 0:
            try:
                self._begin()
            except Exception as e:
                failure = self._named(e, "could not start the push")
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name in view.names():
            t = view.read(name)  # a gather every rank takes part in, failed push or not
            if self.rank != 0 or failure is not None:
                continue
            nbytes = t.numel() * t.element_size()
            if bucket and size + nbytes > self.bucket_bytes:  # full: out before this one
                failure = self._send(bucket, result)
                bucket, size = [], 0
                if failure is not None:
                    continue
            bucket.append((name, t))
            size += nbytes
        getattr(view.src, "done", lambda: None)()
        if self.rank == 0 and failure is None:
            failure = self._send(bucket, result) if bucket else None
            failure = failure or self._end(result)
        said = self._agree(failure, group)
        if said is not None:
            self.group = None  # the next push connects again
            raise EngineError(said) from failure
        result.seconds = time.perf_counter() - start
        result.stall_s = result.seconds if stall < 0 else stall
        return result

    def _begin(self) -> None:
        assert self.engine is not None
        if self.group is None:
            host = self.host or local_address(self.engine)
            store = wire.serve_store(host, self.timeout_s)
            session = uuid.uuid4().hex
            world = 1 + self.engine.world_size()
            info = {"host": host, "port": store.port, "session": session, "world_size": world,
                    "timeout_s": self.timeout_s}  # fmt: skip
            opened = _Call(wire.open_group, host, store.port, 0, world, session, self.timeout_s,
                           store)  # fmt: skip
            self.engine.init(info)  # returns once the engine's workers joined the group
            self.group, self._store = opened.result(self.timeout_s), store
        try:
            self.engine.start()
        except EngineError:  # a session a stopped trainer left open: end it, then start
            self.engine.finish(None)
            self.engine.start()

    def _send(self, bucket: list[tuple[str, torch.Tensor]], result: PushResult) -> Any:
        assert self.engine is not None
        try:
            if self._buffer is None:
                self._buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8)
            buffer, entries = wire.pack(bucket, self._buffer)  # one larger tensor: its own
            work = wire.broadcast(self.group, buffer)
            self.engine.update(wire.message(entries, result.buckets, result.version))
            work.wait()
        except Exception as e:
            return self._named(e, "the push broke off")
        result.buckets += 1
        result.tensors += len(entries)
        result.bytes += buffer.numel()
        result.largest_bucket = max(result.largest_bucket, buffer.numel())
        return None

    def _end(self, result: PushResult) -> Any:
        assert self.engine is not None
        try:
            self.engine.update({"end": True, "count": result.tensors, "bucket": result.buckets,
                                "version": result.version})  # fmt: skip
            began = time.perf_counter()
            self.engine.pause()
            try:
                self.engine.finish(result.version)
            finally:
                self.engine.resume()
            result.swap_s = time.perf_counter() - began
        except Exception as e:
            return self._named(e, "the push did not finish")
        return None

    def _named(self, e: Exception, what: str) -> EngineError:
        """``e`` as an ``EngineError`` whose message names the engine."""
        assert self.engine is not None
        if isinstance(e, EngineError) and self.engine.name in str(e):
            return e
        return EngineError(f"{self.engine.name}: {what}: {e}")

    def _agree(self, failure: BaseException | None, group: Any) -> str | None:
        """Rank 0's failure, said on every rank (None: the push went through)."""
        said = [None if failure is None else str(failure)]
        if self.world > 1:
            dist.broadcast_object_list(said, src=0, group=group)
        return said[0]


class _Call:
    """``fn(*args)`` in a thread: the trainer's side of a rendezvous, which blocks until the
    engine's side joins (a thread left behind if the engine never does)."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.error: BaseException | None = None
        self.value: Any = None
        self.thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self.thread.start()

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            self.value = fn(*args)
        except BaseException as e:
            self.error = e

    def result(self, timeout: float | None) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise EngineError(f"the engine did not join the push's group in {timeout:.0f} s")
        if self.error is not None:
            raise self.error
        return self.value


def push_weights(model: Any, engine: Any, version: str | int | None = None, **options: Any):
    """One push of ``model`` into ``engine`` (``WeightPusher``'s options); a loop that pushes
    often keeps one ``WeightPusher``, which keeps its connection."""
    return WeightPusher(engine, **options).push(model, version)
