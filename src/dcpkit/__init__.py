"""dcpkit: checkpointing for PyTorch distributed training."""

__version__ = "0.1.0"

from dcpkit.config import CheckpointConfig, ConfigError
from dcpkit.manager import CheckpointError, CheckpointManager

__all__ = ["CheckpointConfig", "CheckpointError", "CheckpointManager", "ConfigError", "__version__"]
