"""dcpkit's one line per save and per load, seen in a user's own loop without configuring
logging (as TorchTitan's checkpointer prints its own).

The lines are INFO records of dcpkit's loggers, as always. Python drops INFO records until an
application configures logging, so while it has not (the root logger has no handler, and the
``dcpkit`` logger no level or handler of its own), rank 0 also prints them on stderr. Once
logging is configured they go where it says, once. ``logging.getLogger("dcpkit").setLevel(
logging.WARNING)`` turns them off.
"""

from __future__ import annotations

import logging
import sys

from dcpkit import dist


def summary(logger: logging.Logger, message: str) -> None:
    """Log ``message`` (a save's or a load's one line) at INFO, and print it while nothing
    would show it."""
    logger.info(message)
    ours = logging.getLogger("dcpkit")
    unconfigured = not logging.getLogger().handlers and ours.level == logging.NOTSET
    quiet = ours.handlers or logger.isEnabledFor(logging.INFO) or dist.rank() != 0
    if unconfigured and not quiet:
        print(message, file=sys.stderr, flush=True)
