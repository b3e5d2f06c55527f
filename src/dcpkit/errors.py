"""The errors dcpkit raises for a checkpoint that cannot be saved or loaded."""


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
