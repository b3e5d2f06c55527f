"""The errors dcpkit raises, and how the command line describes any error in one paragraph."""

import errno
import shutil
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which one and why."""


class CorruptCheckpoint(CheckpointError, ValueError):
    """A checkpoint folder that breaks a rule of its format or its manifest (damaged, or crafted
    by whoever handed it over): raised by every entry point (loads, tools, integrations), its
    message names the file, the key and the rule broken."""


def first_failure(e: BaseException) -> BaseException:
    """The exception a rank raised inside ``torch.distributed.checkpoint``, which wraps it in a
    ``CheckpointException`` (a ``BaseException``, with a traceback in its message)."""
    for failure in getattr(e, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return first_failure(inner)
    return e


def disk_full(e: BaseException, free: int | None) -> bool:
    """Whether a write failed for want of space: ENOSPC or EDQUOT, or - with under 64 MiB left
    (``free`` bytes) - torch's archive writer's "unexpected pos", which hides ENOSPC."""
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(e):
        return True
    return free is not None and "unexpected pos" in str(e) and free < (64 << 20)


def out_of_space(e: BaseException, path: Path) -> BaseException:
    """``e``, or, when it is a full disk under ``path``, an ``OSError(ENOSPC)`` that says so
    with the space left (torch's own message for it is "unexpected pos 704 vs 598")."""
    folder = next((p for p in (path, *path.parents) if p.exists()), None)
    usage = shutil.disk_usage(folder) if folder is not None else None
    if not disk_full(e, usage.free if usage else None):
        return e
    from dcpkit.units import human_bytes

    have = f" ({human_bytes(usage.free)} free of {human_bytes(usage.total)})" if usage else ""
    return OSError(errno.ENOSPC, f"writing {path}: the disk is full{have}; free space there")


class CLIError(Exception):
    """An error for the person at the terminal: what, why, how to fix."""


def describe_error(e: BaseException) -> str:
    """One paragraph for the terminal: what went wrong and, where it helps, how to fix it."""
    if isinstance(e, PermissionError):
        return (
            f"permission denied: {e.filename or e}; check the file's owner and mode, or run "
            "as a user who can read (and, for outputs, write) it"
        )
    if isinstance(e, IsADirectoryError | NotADirectoryError):
        return f"{e.filename}: {e.strerror.lower() if e.strerror else e}"
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"{e.filename} does not exist"
    text = str(e) or type(e).__name__
    return (
        text
        if isinstance(e, ValueError | OSError | RuntimeError | CLIError)
        else (f"{type(e).__name__}: {text}")
    )


_TRANSIENT_NAMES = {
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionClosedError",
    "ClientConnectorError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ServerTimeoutError",
}
_TRANSIENT_WORDS = ("slowdown", "throttl", "requesttimeout", "service unavailable", "503")


def transient(e: BaseException) -> bool:
    """An error worth retrying: the store did not answer, reset the connection, or throttled."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, ConnectionError | TimeoutError) or type(e).__name__ in _TRANSIENT_NAMES:
            return True
        if isinstance(e, OSError) and e.errno == errno.EIO:  # a network file system's failure
            return True
        text = str(e).lower()
        if any(w in text for w in _TRANSIENT_WORDS) or any(
            n.lower() in text for n in _TRANSIENT_NAMES
        ):
            return True
        e, seen = (e.__cause__ or e.__context__), seen + 1  # type: ignore[assignment]
    return False
