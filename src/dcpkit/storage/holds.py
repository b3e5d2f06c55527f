"""Readers hold what they read: a step being loaded, verified or exported is never deleted by the
run's retention under it.

A reader (``dcpkit verify``, ``to-hf``, a load, an evaluation job that follows the run) writes a
hold into the checkpoint folder, ``.dcpkit-holds/hold-ID.json``: host, pid, what it does, the
step (or, for a follower, every step from one on), a heartbeat renewed by a background thread,
and how long the hold lasts without one (``expires_s``; a reader killed outright stops holding
after that). Markers work on every store, local or object store, across hosts.

Retention deletes a step only when no live hold covers it, by a protocol with no window: the
deleter writes ``deleting-step-N.json`` and then reads the holds; a reader writes its hold and
then reads the deleting markers and checks that the step is still published. Whichever writes
second sees the other's marker: the deleter keeps the step (the last reader to let go deletes
it, or a later save does), or the reader lets go and chooses again. A reader never blocks a
save.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from dcpkit.console import summary
from dcpkit.layout import parse_step, step_name
from dcpkit.storage.markers import MAX_RECORD, fresh, read_record, readable

logger = logging.getLogger(__name__)

HOLDS = ".dcpkit-holds"
DELETING = "deleting-"
KEPT = "kept-"
"""``kept-step-N.json``: retention would have deleted step N but a reader held it; the last
reader to let go deletes it (the run may have ended: no later save would)."""
READ_ONLY = frozenset({"list", "verify", "inspect", "diff"})
"""Readers that never delete: a step they held past the run's retention is deleted by the run's
next save, or by a reader that loads or exports letting go of it."""
HOLD_PREFIX = "hold-"
DEFAULT_EXPIRY_S = 60.0
STALE_DELETING_S = 600.0
"""A deleting marker older than this was left by a deleter that died before removing it."""


def expiry_s() -> float:
    """How long a hold lasts without a heartbeat: ``DCPKIT_HOLD_EXPIRY_S``, else 60 s."""
    text = os.environ.get("DCPKIT_HOLD_EXPIRY_S", "")
    try:
        value = float(text) if text else DEFAULT_EXPIRY_S
    except ValueError:
        raise ValueError(f"DCPKIT_HOLD_EXPIRY_S = {text!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"DCPKIT_HOLD_EXPIRY_S must be > 0, got {text}")
    return value


class StepGone(Exception):
    """The step is no longer published (retention deleted it, or is deleting it)."""


def alive(record: dict[str, Any], now: float) -> bool:
    """Whether the hold ``record`` is live at ``now`` (its heartbeat fresh)."""
    return fresh(record.get("heartbeat"), record.get("expires_s"), now)


def live_holds(store: Any) -> list[dict[str, Any]]:
    """Every hold in ``store``'s folder whose heartbeat is fresh (expired ones are left alone:
    a reader whose heartbeat is late may still be reading; they stop counting, nothing else)."""
    now = time.time()
    holds = []
    for name in store.list_names(HOLDS):
        if name.startswith(HOLD_PREFIX) and name.endswith(".json"):
            record = read_record(store, f"{HOLDS}/{name}")
            if record is not None and alive(record, now):
                holds.append(record)
    return holds


def covers(record: dict[str, Any], step: int) -> bool:
    """Whether the hold ``record`` holds ``step``."""
    if isinstance(record.get("from"), int):
        return step >= record["from"]
    return record.get("step") == step


def held_steps(store: Any, steps: list[int]) -> dict[int, list[dict[str, Any]]]:
    """``{step: [holds]}`` for the ``steps`` some live reader holds."""
    holds = live_holds(store)
    found = {s: [h for h in holds if covers(h, s)] for s in steps}
    return {s: h for s, h in found.items() if h}


def describe(record: dict[str, Any]) -> str:
    """One holder, for a log line: what it does, where, and its last heartbeat."""
    age = time.time() - float(record.get("heartbeat") or 0)
    return (
        f"{record.get('purpose', 'a reader')} (host {record.get('host')}, pid "
        f"{record.get('pid')}, heartbeat {age:.0f}s ago)"
    )


def _deleting_record(store: Any, name: str) -> dict[str, Any] | None:
    """The deleter's marker of step ``name`` (None: none, or stale: its deleter died)."""
    marker = f"{HOLDS}/{DELETING}{name}.json"
    record = read_record(store, marker)
    if record is None:  # being written (there, undecided), or no file that could be one
        return {} if readable(store, marker) else None
    started = record.get("started")
    recent = isinstance(started, int | float) and time.time() - started < STALE_DELETING_S
    return record if recent else None


def being_deleted(store: Any, name: str, wait_s: float = 30.0) -> bool:
    """Whether retention is deleting step ``name``. A deleter that has not decided yet (it is
    reading the holds) is waited for, up to ``wait_s``: it keeps the step when it sees a hold
    written before it looked, and then removes its marker."""
    deadline = time.monotonic() + wait_s
    while True:
        record = _deleting_record(store, name)
        if record is None:
            return False
        if record.get("deleting") or time.monotonic() > deadline:
            return True
        time.sleep(0.05)


def delete_unless_held(store: Any, step: int, delete: Callable[[str], None]) -> list[dict]:
    """Delete step ``step`` with ``delete(name)`` unless a reader holds it: the holds that kept
    it, or [] when it was deleted."""
    name = step_name(step)
    marker = f"{HOLDS}/{DELETING}{name}.json"
    record: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    record["started"] = time.time()
    store.write_bytes(marker, json.dumps(record).encode(), durable=False)
    try:
        holders = [h for h in live_holds(store) if covers(h, step)]
        kept = f"{HOLDS}/{KEPT}{name}.json"
        if holders:
            decision = {"by": "retention", "step": step, "since": time.time()}
            decision["held_by"] = [h.get("id") for h in holders]
            store.write_bytes(kept, json.dumps(decision).encode(), durable=False)
            return holders
        record["deleting"] = True  # decided: a reader that wrote its hold since backs off
        store.write_bytes(marker, json.dumps(record).encode(), durable=False)
        delete(name)
        store.remove(kept)
        return []
    finally:
        with contextlib.suppress(Exception):
            store.remove(marker)
            store.remove_empty_folder(HOLDS)


def not_a_decision(store: Any, name: str, step: int, newest: int | None) -> str | None:
    """What is wrong with ``kept-step-N.json`` as retention's record of keeping step ``step``
    for a reader (None: it is one, and the step is older than ``newest``, the newest published
    step)."""
    record = read_record(store, f"{HOLDS}/{name}")
    if record is None:
        return f"not a JSON record of at most {MAX_RECORD // 1024} KiB"
    if record.get("by") != "retention" or record.get("step") != step:
        return f"it does not name step {step} as kept by retention"
    if newest is not None and step >= newest:
        return f"step-{step} is the newest published step, which retention never deletes"
    return None


class Hold:
    """A reader's hold on step ``step`` of ``store`` (or, with ``follow``, on every step from
    ``step`` on), renewed by a background thread until ``release()``."""

    def __init__(
        self,
        store: Any,
        step: int,
        purpose: str,
        follow: bool = False,
        expires_s: float | None = None,
    ) -> None:
        self.store, self.step, self.follow = store, step, follow
        self.expires_s = expires_s if expires_s is not None else expiry_s()
        self.id = uuid.uuid4().hex
        self.file = f"{HOLDS}/{HOLD_PREFIX}{self.id}.json"
        self.record: dict[str, Any] = {
            "id": self.id,
            "purpose": purpose,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "expires_s": self.expires_s,
        }
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.lapsed_at: tuple[float, float] | None = None  # (when it expired, the gap)

    def lapsed(self) -> str | None:
        """Why the held step may be gone though it was held: the hold expired (its process was
        stopped longer than the expiry, so no heartbeat renewed it), said with when; None when
        it never lapsed."""
        beat = self.record.get("heartbeat")
        if self.lapsed_at is None and beat is not None and time.time() - beat > self.expires_s:
            self.lapsed_at = (beat + self.expires_s, time.time() - beat)
        if self.lapsed_at is None:
            return None
        at, gap = self.lapsed_at
        return (
            f"the hold on {self.location} expired at "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))}, {gap:.0f}s after its "
            f"last heartbeat (a hold lasts {self.expires_s:.0f}s without one: was this process "
            "stopped?), and the run's retention deleted the step meanwhile"
        )

    @property
    def name(self) -> str:
        return step_name(self.step)

    @property
    def location(self) -> str:
        """The held step's path or URL."""
        return self.store.location(self.name)

    def _write(self) -> None:
        with self._lock:
            self.record.pop("step", None)
            self.record.pop("from", None)
            self.record["from" if self.follow else "step"] = self.step
            now, last = time.time(), self.record.get("heartbeat")
            if last is not None and now - last > self.expires_s and self.lapsed_at is None:
                self.lapsed_at = (last + self.expires_s, now - last)  # paused past its expiry
            self.record["heartbeat"] = now
            self.store.write_bytes(self.file, json.dumps(self.record).encode(), durable=False)

    def acquire(self) -> None:
        """Hold the step; raise ``StepGone`` (holding nothing) when it is no longer published or
        retention is deleting it. A follower's hold always succeeds."""
        self._write()
        if not self.follow and (
            being_deleted(self.store, self.name) or not self.store.is_published(self.name)
        ):
            self._remove()
            raise StepGone(f"{self.location} is no longer published (retention deleted it)")
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew, name="dcpkit-hold", daemon=True)
            self._thread.start()

    def move_to(self, step: int) -> None:
        """A follower: hold every step from ``step`` on (the ones before are let go)."""
        before, self.step = self.step, step
        self._write()
        self._finish_retention(lambda s: before <= s < step)

    def _finish_retention(self, released: Callable[[int], bool]) -> None:
        """Delete the ``released`` steps retention kept for a reader, unless another reader
        holds one (no later save may come). Only retention's own record of its decision, naming
        the step, deletes one, never the newest; a ``READ_ONLY`` reader deletes nothing."""
        if self.record["purpose"] in READ_ONLY:
            return
        try:
            names = self.store.list_names(HOLDS)
        except Exception:  # the next save's retention deletes them
            return
        newest: list[int | None] = []  # the folder's newest step, listed once if needed
        for name in names:
            step = parse_step(name.removeprefix(KEPT).removesuffix(".json"))
            if not name.startswith(KEPT) or step is None or not released(step):
                continue
            if not newest:
                newest.append(max(self.store.published_steps(), default=None))
            problem = not_a_decision(self.store, name, step, newest[0])
            if problem is not None:
                where = self.store.location(f"{HOLDS}/{name}")
                logger.warning("checkpoint: %s is no decision of retention (%s)", where, problem)
                continue
            try:
                if not delete_unless_held(self.store, step, self.store.delete):
                    summary(
                        logger,
                        f"checkpoint: deleted {self.store.location(step_name(step))}, which the "
                        "run's retention kept while it was held (this "
                        f"{self.record['purpose']} was the last to hold it)",
                    )
            except Exception as e:  # a reader that may not delete: the next save does
                logger.warning(
                    "checkpoint: could not delete %s, which retention kept while it was "
                    "held: %s; the run's next save deletes it",
                    self.store.location(step_name(step)),
                    e,
                )

    def _renew(self) -> None:
        while not self._stop.wait(self.expires_s / 4):
            try:
                self._write()
            except Exception as e:  # a transient store error: the next beat tries again
                logger.warning("checkpoint: could not renew the hold on %s: %s", self.location, e)

    def _remove(self) -> None:
        try:
            self.store.remove(self.file)
            self.store.remove_empty_folder(HOLDS)
        except Exception as e:  # it expires anyway
            logger.warning("checkpoint: could not release the hold %s: %s", self.file, e)

    def release(self, wait: bool = True) -> None:
        """Let go (and delete what retention kept for this hold alone). ``wait=False``: in the
        background, for a reader that failed (its store may not answer: the hold expires)."""
        self._stop.set()
        if not wait:
            threading.Thread(target=self.release, name="dcpkit-release", daemon=True).start()
            return
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._remove()
        start = self.step
        self._finish_retention((lambda s: s >= start) if self.follow else (lambda s: s == start))

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release(wait=exc[0] is None)


def hold_step(store: Any, step: int, purpose: str) -> Hold:
    """Hold step ``step`` of ``store`` (``StepGone`` when it is no longer published)."""
    hold = Hold(store, step, purpose)
    hold.acquire()
    return hold


def hold_latest(
    store: Any, purpose: str, check: Callable[[str], str | None] | None = None
) -> tuple[int, Hold | None, list[str]]:
    """Hold the newest published step of ``store`` that passes ``check(name)`` (None: fine;
    else what is wrong), chosen and held in one operation. Returns the step, its hold (None
    where the reader may not write into the folder: read without a hold, said in a note) and a
    note for each newer step passed over. Raises ``FileNotFoundError`` when no step qualifies."""
    notes: list[str] = []
    tried: set[int] = set()
    holding = True
    while True:
        candidates = [s for s in store.published_steps() if s not in tried]
        if not candidates:
            have = "no published step" if not tried else "no other published step"
            raise FileNotFoundError(
                f"{store.root} has {have} to read as `latest`"
                + (f" ({'; '.join(notes)})" if notes else "")
            )
        step = max(candidates)
        tried.add(step)
        hold = None
        try:
            hold = hold_step(store, step, purpose) if holding else None
        except StepGone:
            continue  # deleted between the listing and the hold: the next newest
        except Exception as e:  # a folder this reader may not write to
            holding = False
            notes.append(
                f"could not hold a step of {store.root} against retention ({type(e).__name__}: "
                f"{e}); reading without a hold"
            )
            logger.warning("checkpoint: %s", notes[-1])
        problem = check(step_name(step)) if check is not None else None
        if problem is None:
            return step, hold, notes
        if hold is not None:
            hold.release()
        location = store.location(step_name(step))
        notes.append(f"{location} is corrupt ({problem}); `latest` is the step before it")
        logger.info("checkpoint: %s", notes[-1])  # the caller says it: see readers._resolved


@contextlib.contextmanager
def letting_go(hold: Any, before: Callable[[], None] | None = None) -> Iterator[None]:
    """Release ``hold`` (a ``Hold``, anything with its ``release(wait)``, or None) when the
    block ends: after ``before()`` (every rank's barrier) when it ends normally, at once when
    a generator around it is closed, and in the background when it fails (the store may be
    the one that failed: never wait on it; the hold expires anyway)."""
    try:
        yield
    except GeneratorExit:
        if hold is not None:
            hold.release()
        raise
    except BaseException:
        if hold is not None:
            hold.release(wait=False)
        raise
    if before is not None:
        before()
    if hold is not None:
        hold.release()
