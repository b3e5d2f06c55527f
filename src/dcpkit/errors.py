"""The errors dcpkit raises, and how the command line describes any error in one paragraph."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which one and why."""


def first_failure(e: BaseException) -> BaseException:
    """The exception a rank raised inside ``torch.distributed.checkpoint``, which wraps it in a
    ``CheckpointException`` (a ``BaseException``, with a traceback in its message)."""
    for failure in getattr(e, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return first_failure(inner)
    return e


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
