"""The training's Python random stream, kept out of reach of the object-store clients.

Python's ``random`` module is one generator per process. The HTTP stack under s3fs draws from
it on its own schedule: botocore's retry backoff jitter (``botocore.retries.standard``,
``botocore.retryhandler``), urllib3's retry jitter, and aiohttp's connection pool, which
shuffles its waiting queues whenever more requests are in flight than it has connections. A
save or load that happens to be retried, or to wait for a connection, would then move the
training loop's own stream (data augmentation, sampling), and neither an uninterrupted run nor a
resumed one would draw what the other draws. Each of these modules gets a generator of its own
the first time dcpkit opens an fsspec store; their jitter and shuffles are as random as before.

Imports draw too: ``rich`` (which s3fs -> aiobotocore -> httpx imports) takes
``random.getrandbits(24)`` when it is first imported. A store opened after the training seeded
its generators imports them then; ``imports_kept_off_stream`` puts the stream back where it was
when the block imported anything.
"""

from __future__ import annotations

import contextlib
import importlib
import random
import sys
from collections.abc import Iterator

_MODULES = ("aiohttp.connector", "botocore.retryhandler", "urllib3.util.retry")
_done = False


def isolate() -> None:
    """Give the object-store clients' modules their own random generator (once)."""
    global _done
    if _done:
        return
    _done = True
    own = random.Random()
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if getattr(module, "random", None) is random:
            module.random = own  # ``random.shuffle(...)`` there now draws from ``own``
    try:
        from botocore.retries.standard import ExponentialBackoff
    except ImportError:
        return
    init = ExponentialBackoff.__init__  # its default ``random=random.random`` is bound already
    if init.__defaults__:
        init.__defaults__ = tuple(
            own.random if d is random.random else d for d in init.__defaults__
        )


@contextlib.contextmanager
def imports_kept_off_stream() -> Iterator[None]:
    """Run a block that may import the store's packages; if it imported any module, put
    Python's random stream back where it was before (an import draws nothing the training
    asked for)."""
    state, loaded = random.getstate(), len(sys.modules)
    try:
        yield
    finally:
        if len(sys.modules) != loaded:
            random.setstate(state)
