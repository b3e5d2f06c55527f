"""One writer per checkpoint folder: a lease that a run holds while it may save.

Two runs saving into one folder (a second start by mistake, a scheduler's retry while the first
still runs) delete each other's in-flight steps as leftovers and interleave saves and retention.
So rank 0 of a run that saves takes a lease first: ``.dcpkit-lease`` in the folder, with host,
pid, run id, start time and a heartbeat renewed by a background thread (object stores have no
locks; a heartbeat works on every store). A run that finds a live lease stops at start, naming
the holder. A lease whose holder is gone (a dead pid on this host, or a heartbeat older than
``lease_timeout_s``) is taken over, and the takeover is logged. Leftovers are cleaned only after
the lease is held, so they are never another live run's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
import weakref
from typing import Any

from dcpkit.engine.publish import retrying_alone
from dcpkit.errors import CheckpointError
from dcpkit.layout import LEASE
from dcpkit.storage import StoreError
from dcpkit.storage.exclusive import create_exclusive
from dcpkit.storage.markers import fresh, read_bounded

logger = logging.getLogger(__name__)

__all__ = ["LEASE", "Lease", "check_free", "check_lease", "release_folder", "take_lease"]


def _plain(run_id: Any) -> str:
    """A run id as part of a file name (what a lease file says is not trusted as one)."""
    text = str(run_id)
    return text if re.fullmatch(r"[0-9A-Za-z_-]{1,64}", text) else "unnamed"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """The lease of ``store`` for this run (rank 0 only)."""

    def __init__(self, store: Any, timeout_s: float, memory_every: int = 0) -> None:
        self.store, self.timeout_s = store, timeout_s
        self.record = {
            "run_id": uuid.uuid4().hex,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "heartbeat": time.time(),
            "timeout_s": timeout_s,  # for readers following the run: when it is gone
            "memory_every": memory_every,  # memory-tier saves between durable ones (readers)
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._claim: str | None = None  # a takeover's claim, removed with the lease
        self.lost: str | None = None

    def _read(self, name: str = LEASE) -> dict[str, Any] | None:
        """The lease's record (or a takeover claim's); None when there is none, or what is there
        is no record (it is rewritten). A store that fails to answer raises: never taken for a
        free folder."""
        try:
            data = read_bounded(self.store, name) if self.store.exists(name) else None
        except FileNotFoundError:
            return None  # released in between
        try:
            holder = json.loads(data) if data else None
        except ValueError:
            return None
        return holder if isinstance(holder, dict) else None

    def _write(self) -> None:
        self.record["heartbeat"] = time.time()
        self.store.write_bytes(LEASE, json.dumps(self.record).encode())

    def holder_alive(self, holder: dict[str, Any]) -> bool:
        if holder.get("host") == self.record["host"] and isinstance(holder.get("pid"), int):
            return _pid_alive(holder["pid"])
        return fresh(holder.get("heartbeat"), self.timeout_s, time.time())

    def check(self) -> None:
        """Raise naming the holder when another live process holds the lease (reads only)."""
        holder = self._read()
        if holder is not None and not self._same_process(holder) and self.holder_alive(holder):
            raise CheckpointError(self._in_use(holder))

    def _same_process(self, holder: dict[str, Any]) -> bool:
        return (holder.get("host"), holder.get("pid")) == (self.record["host"], self.record["pid"])

    def acquire(self) -> None:
        """Take the lease, or raise naming the run that holds it. Of runs that start at once,
        one wins: the lease (or, over a holder that is gone, a claim named after that holder) is
        created only if it does not exist, as one operation of the store (``exclusive``)."""
        holder = self._read()
        claim: str | None = LEASE if holder is None else None
        if holder is not None and self._same_process(holder):
            pass  # another manager of this process: the newest one saves (the other may not)
        elif holder is not None and holder.get("run_id") != self.record["run_id"]:
            if self.holder_alive(holder):
                raise CheckpointError(self._in_use(holder))
            logger.warning(
                "checkpoint: taking over the lease of %s from run %s (host %s, pid %s): its "
                "holder is gone",
                self.store.root,
                holder.get("run_id"),
                holder.get("host"),
                holder.get("pid"),
            )
            claim = f"{LEASE}.takeover-{_plain(holder.get('run_id'))}"
        self.store.check_reachable()
        self.record["heartbeat"] = time.time()
        created = True
        if claim is not None:
            created = create_exclusive(self.store, claim, json.dumps(self.record).encode())
        found = self.store.stat(LEASE) if created is False and claim == LEASE else None
        if found is not None and self._read() is None:  # a lease file that holds no record
            claim = f"{LEASE}.takeover-unreadable-{int(found.mtime or 0)}"
            created = create_exclusive(self.store, claim, json.dumps(self.record).encode())
        if created is False:  # another run created it first: it runs, this one does not
            raise CheckpointError(self._in_use(self._read(claim or LEASE) or {}))
        if created is None:  # no such operation on this store: a write, then a re-read
            logger.warning(
                "checkpoint: %s cannot create a file only if it is absent: of two runs started "
                "within %.1fs of each other, both may take its lease",
                self.store.root,
                min(0.2, self.timeout_s / 10),
            )
            self._write()
            time.sleep(min(0.2, self.timeout_s / 10))
            winner = self._read()  # two runs that started at once: the last write wins
            if winner is None or winner.get("run_id") != self.record["run_id"]:
                raise CheckpointError(self._in_use(winner or {}))
        elif claim != LEASE:  # the same process's lease, or a takeover this run won
            self._write()
            self._claim = claim
        self._thread = threading.Thread(target=self._renew, name="dcpkit-lease", daemon=True)
        self._thread.start()

    def _in_use(self, holder: dict[str, Any]) -> str:
        age = time.time() - float(holder.get("heartbeat") or 0)
        started = time.strftime(
            "%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started") or 0))
        )
        return (
            f"{self.store.root} is in use by another run (run {holder.get('run_id')}, host "
            f"{holder.get('host')}, pid {holder.get('pid')}, started {started}, heartbeat "
            f"{age:.0f}s ago): two runs saving into one folder destroy each other's "
            "checkpoints. Wait for it to finish, stop it, or use another [checkpoint] folder; "
            f"a lease whose holder is gone is taken over (after {self.timeout_s:.0f}s without "
            "a heartbeat from another host)"
        )

    def _renew(self) -> None:
        while not self._stop.wait(self.timeout_s / 4):
            try:
                holder = self._read()
                if holder is not None and holder.get("run_id") != self.record["run_id"]:
                    self.lost = (
                        f"{self.store.root}: run {holder.get('run_id')} (host "
                        f"{holder.get('host')}, pid {holder.get('pid')}) took over this run's "
                        "lease (was this run paused longer than lease_timeout_s?)"
                    )
                    logger.error("checkpoint: %s", self.lost)
                    return
                self._write()
            except Exception as e:  # a transient store error: try again at the next beat
                logger.warning(
                    "checkpoint: could not renew the lease of %s: %s", self.store.root, e
                )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        try:
            holder = self._read()
            if holder is not None and holder.get("run_id") == self.record["run_id"]:
                self.store.remove(LEASE)
            if self._claim is not None:
                self.store.remove(self._claim)
        except Exception as e:  # never fail a run's end over its lease; it expires anyway
            logger.warning("checkpoint: could not release the lease of %s: %s", self.store.root, e)


_WRITERS: dict[str, weakref.ref] = {}  # folder -> the manager that may save there, this process
_WRITERS_LOCK = threading.Lock()


def _claim(store: Any, owner: Any, claim: bool) -> None:
    """Each rank for itself: raise when another live manager of this process has saved into
    ``store``'s folder; with ``claim``, ``owner`` becomes the one (until ``release_folder``)."""
    with _WRITERS_LOCK:
        held = _WRITERS.get(store.root)
        other = held() if held is not None else None
        if other is not None and other is not owner:
            raise CheckpointError(
                f"{store.root} is already the checkpoint folder of another CheckpointManager of "
                "this process, which has saved there: two managers saving into one folder "
                "replace each other's steps. Close the first one (close(), or a with block) "
                "before creating another, or give each its own folder (CheckpointConfig.folder)"
            )
        if claim:
            _WRITERS[store.root] = weakref.ref(owner)


def check_free(store: Any, timeout_s: float, owner: Any = None) -> None:
    """Every rank: raise on every rank when another live run holds the folder's lease, or (each
    rank for itself) when another live manager of this process has saved into it."""
    from dcpkit import dist

    if owner is not None:
        _claim(store, owner, claim=False)
    check = _retried(Lease(store, timeout_s).check, "read", store, owner)
    error = dist.first_rank_error(check, (CheckpointError,))
    if error:
        raise CheckpointError(error)


def release_folder(store: Any, owner: Any) -> None:
    """``owner`` no longer saves into ``store``'s folder: another manager of this process may."""
    with _WRITERS_LOCK:
        held = _WRITERS.get(store.root)
        if held is not None and held() in (owner, None):
            del _WRITERS[store.root]


def take_lease(store: Any, timeout_s: float, owner: Any = None) -> Lease | None:
    """Every rank: rank 0 takes the lease (the others get None); raises on every rank when the
    folder is in use. ``owner``: the manager, which claims the folder in this process too."""
    from dcpkit import dist

    if owner is not None:
        _claim(store, owner, claim=True)

    memory_every = getattr(getattr(owner, "config", None), "local_interval", 0) or 0
    lease = Lease(store, timeout_s, memory_every) if dist.rank() == 0 else None
    acquire = _retried(lease.acquire, "taken", store, owner) if lease else list
    error = dist.first_rank_error(acquire, (CheckpointError,))
    if error:
        raise CheckpointError(error)
    return lease


def _retried(fn: Any, done: str, store: Any, owner: Any) -> Any:
    """``fn`` tried again while the store does not answer, within the owner's storage_retry_s;
    a store that still fails is a ``CheckpointError`` saying that the lease could not be
    ``done`` (never a folder taken for free because its lease could not be read)."""
    retry_s = float(getattr(getattr(owner, "config", None), "storage_retry_s", 0.0))

    def run() -> None:
        try:
            retrying_alone(fn, retry_s)
        except (StoreError, OSError) as e:
            raise CheckpointError(
                f"{store.root}: its lease ({LEASE}) could not be {done}: {type(e).__name__}: "
                f"{e}; retried for {retry_s:.0f}s ([checkpoint] storage_retry_s)"
            ) from None

    return run


def check_lease(lease: Lease | None) -> None:
    """Every rank, before a save: raise on every rank if another run took the lease over."""
    from dcpkit import dist

    error = dist.broadcast_object(lease.lost if lease is not None else None)
    if error:
        raise CheckpointError(error)
