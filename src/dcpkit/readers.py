"""What a reader reads, held against the run's retention while it reads (see
``storage.holds``): a checkpoint named by its path, a step of a checkpoint folder by number, or
``latest``, chosen and held in one operation; and following a run, each step it publishes, in
order, held from the moment the follower starts until it has been read.

A run is told apart from its folder by the writer's lease (``.dcpkit-lease``): taken at its
first save, released when it closes, its heartbeat renewed meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcpkit.console import summary
from dcpkit.errors import CheckpointError
from dcpkit.integrity import verify_checkpoint
from dcpkit.layout import LEASE, parse_step, step_name
from dcpkit.storage import CheckpointView, open_location, open_store
from dcpkit.storage.holds import (
    Hold,
    StepGone,
    being_deleted,
    hold_latest,
    hold_step,
    letting_go,
)
from dcpkit.storage.markers import fresh, read_record

logger = logging.getLogger(__name__)
LATEST = "latest"


@contextlib.contextmanager
def held_view(
    path_or_url: str | Path,
    storage_options: dict[str, Any] | None = None,
    data: bool = True,
    step: int | str | None = None,
    purpose: str = "read",
) -> Iterator[CheckpointView]:
    """``storage.open_checkpoint``, held against retention while it is read (see
    ``open_reading``)."""
    with (
        reading(path_or_url, step, purpose, storage_options) as held,
        held.store.view(held.name, data=data) as view,
    ):
        yield view


@dataclass
class Reading:
    """What a reader reads: ``name`` in ``store``, and the hold that keeps retention off it
    (None: not a step of a checkpoint folder, or a folder the reader may not write to)."""

    store: Any
    name: str
    hold: Hold | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def location(self) -> str:
        return self.store.location(self.name)

    def release(self, wait: bool = True) -> None:
        if self.hold is not None:
            self.hold.release(wait)
            self.hold = None


def steps_folder(path_or_url: str | Path, storage_options: dict[str, Any] | None = None) -> Any:
    """The store of the checkpoint folder ``path_or_url``, or of its ``checkpoint`` folder when
    it is a run's folder (no published step of its own, and its ``checkpoint`` has some)."""
    store = open_store(path_or_url, storage_options)
    if not store.published_steps():
        inner = open_store("checkpoint", storage_options, base=path_or_url)
        if inner.published_steps():
            return inner
    return store


def open_reading(
    path_or_url: str | Path,
    step: int | str | None = None,
    purpose: str = "read",
    storage_options: dict[str, Any] | None = None,
) -> Reading:
    """Resolve and hold what a reader reads: ``path_or_url`` a checkpoint (``step-N``, held
    while published), or a checkpoint folder with ``step`` (a number, or ``latest``: the
    newest published step that passes the loaders' checks of sizes and structure, chosen and
    held in one operation; a corrupt one is passed over, saying so). A path ending in
    ``/latest`` is its folder with ``step="latest"``. Release with ``Reading.release``."""
    if step is None:
        store, name = open_location(path_or_url, storage_options)
        if name == LATEST and not store.exists(LATEST):
            return _resolved(store.location(""), LATEST, purpose, storage_options)
        if parse_step(name) is None or not store.is_published(name):
            return Reading(store, name)  # not a published step: nothing to hold
        return _held(store, int(parse_step(name)), purpose, Reading(store, name))
    return _resolved(str(path_or_url), step, purpose, storage_options)


_latest_said: dict[str, str] = {}  # by folder: the last `latest` said in this process


def _resolved(
    folder: str, step: int | str, purpose: str, storage_options: dict[str, Any] | None
) -> Reading:
    store = steps_folder(folder, storage_options)
    if str(step) == LATEST or step == -1:
        number, hold, notes = hold_latest(store, purpose, _problem_of(store))
        memory = memory_tier_note(run_state(store)[1])
        held = Reading(store, step_name(number), hold, notes + ([memory] if memory else []))
        how = "held while read" if hold is not None else "not held"
        passed = [n for n in notes if "is corrupt" in n]
        over = f" ({'; '.join(passed)})" if passed else ""
        said = f"checkpoint: `latest` of {store.root} is {held.name}, {how}{over}"
        if _latest_said.get(str(store.root)) != said:  # a polling loop says a change, once
            _latest_said[str(store.root)] = said
            summary(logger, said)
        return held
    if not (isinstance(step, int) or str(step).isdigit()):
        raise ValueError(f"a step is a number or `{LATEST}`, not {step!r}")
    number = int(step)
    if not store.is_published(step_name(number)):
        have = ", ".join(map(str, store.published_steps())) or "none"
        raise FileNotFoundError(
            f"{store.location(step_name(number))} is not a published checkpoint (published "
            f"steps: {have}; `{LATEST}` for the newest)"
        )
    return _held(store, number, purpose, Reading(store, step_name(number)))


def _held(store: Any, step: int, purpose: str, reading: Reading) -> Reading:
    try:
        reading.hold = hold_step(store, step, purpose)
    except StepGone:
        raise FileNotFoundError(
            f"{reading.location} does not exist: retention deleted it as this {purpose} began "
            f"(read `{LATEST}` of the folder to hold the newest step as it is chosen)"
        ) from None
    except Exception as e:  # a folder this reader may not write to: read without a hold
        reading.notes.append(
            f"could not hold {reading.location} against retention ({type(e).__name__}: {e}); "
            "reading without a hold"
        )
        logger.warning("checkpoint: %s", reading.notes[-1])
    return reading


def _problem_of(store: Any) -> Any:
    def problem(name: str) -> str | None:
        report = verify_checkpoint(store, name, checksums=False, require_commit=True)
        return None if report.ok else str(report.problems[0])

    return problem


@contextlib.contextmanager
def reading(
    path_or_url: str | Path,
    step: int | str | None = None,
    purpose: str = "read",
    storage_options: dict[str, Any] | None = None,
) -> Iterator[Reading]:
    """``open_reading``, released at the end of the block."""
    held = open_reading(path_or_url, step, purpose, storage_options)
    with letting_go(held):
        try:
            yield held
        except Exception as e:  # a read that failed because the step went while not held
            lapsed = held.hold.lapsed() if held.hold is not None else None
            if lapsed is None or _still_published(held):
                raise
            raise CheckpointError(f"{lapsed}: {e}") from e


def _still_published(held: Reading) -> bool:
    try:
        return bool(held.store.is_published(held.name))
    except Exception:  # the store does not answer: the read's own error says so
        return True


# --- following a run -----------------------------------------------------------------------------


def run_state(store: Any) -> tuple[str, dict[str, Any]]:
    """Whether a run is saving into ``store``'s folder: ``("running" | "stale" | "none",
    lease record)``. Stale: its heartbeat is older than its own ``lease_timeout_s``."""
    record = read_record(store, LEASE, skip_errors=False)  # a store error is no finished run
    if record is None:
        return "none", {}
    alive = fresh(record.get("heartbeat"), record.get("timeout_s", 60.0), time.time())
    return ("running" if alive else "stale"), record


def memory_tier_note(record: dict[str, Any]) -> str | None:
    """What a reader of the durable folder misses of a run with a memory tier."""
    every = record.get("memory_every")
    if not isinstance(every, int) or every <= 0:
        return None
    return (
        f"this run also saves every {every} step(s) to a memory tier, in its processes' memory: "
        "readers read the durable steps of this folder only"
    )


def _target(folder: str | Path, storage_options: dict[str, Any] | None) -> Any:
    """The checkpoint folder to follow: ``folder``, or the ``checkpoint`` folder of a run's
    folder; None while neither has a run or a step."""
    for store in (
        open_store(folder, storage_options),
        open_store("checkpoint", storage_options, base=folder),
    ):
        if run_state(store)[0] != "none" or store.published_steps():
            return store
    return None


def follow(
    folder: str | Path,
    storage_options: dict[str, Any] | None = None,
    purpose: str = "follow",
    poll_s: float = 1.0,
    wait_s: float | None = None,
) -> Iterator[Reading]:
    """Each published step of the run saving into ``folder`` (a checkpoint folder, or a run's
    folder with a ``checkpoint`` one), oldest first, none twice, until the run finishes: every
    step published while the follower runs, and those there when it starts. A step is held
    from when the follower starts (one hold from that step on) until the loop asks for the next
    one. Waits for a run to start when the folder has neither a run nor a step (at most
    ``wait_s``; None: as long as it takes)."""
    start = time.monotonic()
    store = _target(folder, storage_options)
    if store is None:  # said once, so that a person (or a script) knows the follower is ready
        summary(logger, f"checkpoint: waiting for a run to save into {folder}")
    while store is None:
        if wait_s is not None and time.monotonic() - start > wait_s:
            raise TimeoutError(f"no run saved into {folder} within {wait_s:.0f}s")
        time.sleep(poll_s)
        store = _target(folder, storage_options)
    hold = Hold(store, 0, purpose, follow=True)
    hold.acquire()
    with letting_go(hold):  # a loop that stops early lets go of the steps it did not reach
        yield from _steps(store, hold, poll_s)


def _steps(store: Any, hold: Hold, poll_s: float) -> Iterator[Reading]:
    last, told, notes = -1, False, []
    while True:
        state, record = run_state(store)
        if not told and record:
            note = memory_tier_note(record)
            if note:  # logged, and a note of the next step read (a command prints it)
                summary(logger, f"checkpoint: {note}")
                notes.append(note)
            told = True
        for step in sorted(s for s in store.published_steps() if s > last):
            name = step_name(step)
            if being_deleted(store, name) or not store.is_published(name):
                logger.warning(  # only a step retention was deleting as the follow began
                    "checkpoint: %s was being deleted by retention when this follower started; "
                    "skipped",
                    store.location(name),
                )
            else:
                yield Reading(store, name, notes=notes)
                notes = []
            last = step
            hold.move_to(step + 1)
        if state != "running":
            why = {"none": "finished", "stale": "stopped (its lease went stale)"}[state]
            if record or last >= 0:
                summary(logger, f"checkpoint: the run saving into {store.root} {why}: done")
            return
        time.sleep(poll_s)
