"""The errors dcpkit raises for a checkpoint that cannot be saved or loaded."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message says which one and why."""
