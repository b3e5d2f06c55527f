"""The reference trainer: ``python -m dcpkit.train --job.config_file FILE`` under torchrun."""

from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"
"""Example configurations shipped with the package (``configs/`` in a source checkout)."""
