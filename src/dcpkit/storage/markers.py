"""Markers in a checkpoint folder (readers' holds, retention's deleting and kept records, the
run's lease) are claims written by other processes, or by anyone: each is read as a regular file
only (no FIFO, device or socket is opened), at most ``MAX_RECORD`` bytes by what is read, and a
marker that is none of that is no record."""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

MAX_RECORD = 64 * 1024
MAX_SKEW_S = 300.0
"""A heartbeat dated further ahead than this comes from a wrong clock (or is forged): it keeps
nothing alive, or one record would hold a step, or a folder, for good."""


def fresh(beat: Any, expires: Any, now: float) -> bool:
    """Whether a heartbeat ``beat`` (seconds since the epoch) is alive at ``now`` for a record
    that lasts ``expires`` seconds: not older than that, and not dated ahead by more than
    ``MAX_SKEW_S``."""
    numbers = all(isinstance(x, int | float) and not isinstance(x, bool) for x in (beat, expires))
    return numbers and -MAX_SKEW_S <= now - beat < expires


def read_record(store: Any, name: str, skip_errors: bool = True) -> dict[str, Any] | None:
    """A marker's JSON (a hold's, a deleter's, the run's lease), bounded; None when it is gone,
    too large or not a JSON object."""
    try:
        st = store.stat(name)
        data = read_bounded(store, name) if st is not None and st.size <= MAX_RECORD else None
        if data is None:
            return None
        record = json.loads(data)
    except (OSError, ValueError):  # gone, or no regular file (a FIFO, a device): no record
        return None
    except Exception as e:  # a store error other than a vanished file: unreadable, skip it
        if not skip_errors:
            raise
        logger.debug("checkpoint: unreadable marker %s: %s", store.location(name), e)
        return None
    return record if isinstance(record, dict) else None


def read_bounded(store: Any, name: str, limit: int = MAX_RECORD) -> bytes | None:
    """A marker's bytes, at most ``limit`` of them by what is read (None when there are more):
    its stated size can be 0 (a device) or anything."""
    with store.open_read(name) as f:
        data = f.read(limit + 1)
    return None if len(data) > limit else data


def readable(store: Any, name: str) -> bool:
    """Whether ``name`` opens as a regular file (a FIFO, a device or a socket does not)."""
    try:
        with store.open_read(name):
            return True
    except OSError:
        return False
