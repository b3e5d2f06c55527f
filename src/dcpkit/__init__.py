"""dcpkit: checkpointing for PyTorch distributed training."""

__version__ = "0.1.0"

from dcpkit.config import CheckpointConfig, ConfigError
from dcpkit.convert.hf_model import HFModel
from dcpkit.engine.manager import CheckpointManager
from dcpkit.engine.preempt import EXIT_PREEMPTED
from dcpkit.errors import CheckpointError, CorruptCheckpoint
from dcpkit.readers import follow, reading

__all__ = [
    "EXIT_PREEMPTED",
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "ConfigError",
    "CorruptCheckpoint",
    "HFModel",
    "__version__",
    "follow",
    "reading",
]
