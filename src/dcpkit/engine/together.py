"""Ranks that fail together: a load's steps that touch storage run on every rank, and a failure
on one (a store that stopped answering, a broken file) becomes the same error on all, raised at
the same point. A rank never raises alone while the others wait in a collective for it (a caller
that catches the error on one rank would leave the others waiting forever), and an error the
store may get over (``transient``) is a ``StoreUnavailable``: the load retries it within
``storage_retry_s``, every rank alike, as a save does."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dcpkit import dist
from dcpkit.errors import CheckpointError, CorruptCheckpoint, describe_error, transient
from dcpkit.readers import open_reading
from dcpkit.storage import open_location
from dcpkit.storage.holds import letting_go

logger = logging.getLogger(__name__)

T = TypeVar("T")

TRANSIENT, CORRUPT, OTHER = "transient", "corrupt", "other"


class StoreUnavailable(CheckpointError):
    """The store did not answer (or reset, or throttled) while a checkpoint was read: worth
    retrying, and retried by the load within ``storage_retry_s``."""


def failure_of(e: BaseException, location: str) -> tuple[str, str]:
    """``e`` as a failure every rank can raise: its message (naming ``location`` once) and its
    kind."""
    text = describe_error(e)
    message = text if location and location in text else f"{location}: {text}"
    if transient(e):
        return message, TRANSIENT
    return message, CORRUPT if isinstance(e, CorruptCheckpoint) else OTHER


def raise_failure(message: str, kind: str) -> None:
    if kind == TRANSIENT:
        raise StoreUnavailable(message)
    raise (CorruptCheckpoint if kind == CORRUPT else CheckpointError)(message)


def agree(failure: tuple[str, str] | None, gather: bool = True) -> None:
    """Every rank: raise the first failing rank's failure (``failure``: this rank's, None when
    it succeeded) on every rank, with the same message; nothing when every rank succeeded."""
    outcomes = dist.all_gather_object(failure) if gather else [failure]
    failed = [(r, f) for r, f in enumerate(outcomes) if f is not None]
    if not failed:
        return
    rank, (message, kind) = failed[0]
    where = f" (rank {rank})" if gather and dist.world_size() > 1 else ""
    raise_failure(f"{message}{where}", kind)


def together(fn: Callable[[], T], location: str, gather: bool = True) -> T:
    """``fn()`` on every rank; when it raises on any rank, every rank raises that error."""
    try:
        result, failure = fn(), None
    except Exception as e:
        result, failure = None, failure_of(e, location)
    agree(failure, gather)
    return result  # type: ignore[return-value]


def decided(fn: Callable[[], T], location: str) -> T:
    """``fn()`` on rank 0 (a listing, a choice), its result on every rank; when it raises,
    every rank raises that error."""
    result, failure = None, None
    if dist.rank() == 0:
        try:
            result = fn()
        except Exception as e:
            failure = failure_of(e, location)
    result, failure = dist.broadcast_object((result, failure))
    if failure is not None:
        raise_failure(*failure)
    return result  # type: ignore[return-value]


def retrying(fn: Callable[[], T], retry_s: float, what: str) -> T:
    """``fn()`` (whose failures every rank raises together), tried again with backoff while it
    fails with ``StoreUnavailable`` and ``retry_s`` seconds have not passed: rank 0 decides when
    to give up, for every rank. ``what``: the operation, for the log and the final error."""
    deadline, delay = time.monotonic() + retry_s, 1.0
    while True:
        try:
            return fn()
        except StoreUnavailable as e:
            give_up = time.monotonic() + delay > deadline if dist.rank() == 0 else None
            if dist.broadcast_object(give_up):
                raise StoreUnavailable(
                    f"{what} failed: {e}; retried for {retry_s:.0f}s ([checkpoint] "
                    "storage_retry_s): giving up"
                ) from None
            if dist.rank() == 0:
                logger.warning("checkpoint: %s: %s; retrying in %.0fs", what, e, delay)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


@contextlib.contextmanager
def held_everywhere(
    path: Any, step: int | str | None, storage_options: dict[str, Any] | None, purpose: str
) -> Iterator[tuple[Any, str]]:
    """Every rank: ``(store, name)`` of what ``path`` (with ``step``: see ``open_reading``)
    names, resolved and held against its run's retention by rank 0, until every rank has read
    it; a failure to resolve it raises on every rank."""
    held: list[Any] = []  # rank 0's hold, kept here: only its location goes to the others

    def resolve() -> str:
        held.append(open_reading(path, step, purpose, storage_options))
        return held[0].location

    location = decided(resolve, str(path))
    with letting_go(held[0] if held else None, before=dist.barrier):  # read by every rank
        yield open_location(location, storage_options)


def read_held(
    path: Any, step: int | str | None, config: Any, purpose: str, read: Callable[[Any, str], T]
) -> T:
    """Every rank: ``read(store, name)`` of what ``path`` names, held as ``held_everywhere``
    holds it, tried again while the store does not answer, within ``config.storage_retry_s``."""

    def once() -> T:
        with held_everywhere(path, step, config.storage_options, purpose) as (store, name):
            return read(store, name)

    return retrying(once, config.storage_retry_s, f"the {purpose} of {path}")
