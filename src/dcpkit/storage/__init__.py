"""Where checkpoint bytes live: ``open_store`` picks a local folder or an fsspec store, once."""

from dcpkit.storage.base import (
    CheckpointStore,
    CheckpointView,
    PendingStep,
    StepEntry,
    StoreError,
)
from dcpkit.storage.opening import open_checkpoint, open_location, open_store

__all__ = [
    "CheckpointStore",
    "CheckpointView",
    "PendingStep",
    "StepEntry",
    "StoreError",
    "open_checkpoint",
    "open_location",
    "open_store",
]
