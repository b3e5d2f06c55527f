"""Emergency save on preemption: SIGTERM (what torchrun and schedulers send before they kill a job)
makes every rank finish its step, write a durable checkpoint of it, and exit with
``EXIT_PREEMPTED``.

The signal handler only records that the signal came; nothing is saved from inside it. Every
step, the ranks agree through one small all-reduce whether any of them was signalled, so a
signal that reaches only some ranks still stops all of them after the same step. A second
SIGTERM, or ``emergency_timeout_s`` after the first, ends the process at once (exit 143).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch
import torch.distributed as torch_dist

from dcpkit import dist

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75
"""Exit code of a rank that saved its step after SIGTERM (``EX_TEMPFAIL``: run it again)."""
EXIT_KILLED = 128 + signal.SIGTERM
"""Exit code when the grace period ends, or a second SIGTERM comes, before the save is done."""


class Preemption:
    """Watches for SIGTERM in this process (installed from the main thread)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.signalled_at: float | None = None
        self._done = threading.Event()
        self._previous: Any = None
        self._installed = threading.current_thread() is threading.main_thread()
        if self._installed:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        else:
            logger.warning(
                "checkpoint: emergency_save needs the manager to be created in the main thread "
                "(signal handlers live there); SIGTERM keeps its default action"
            )

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signalled_at is not None:
            os.write(2, b"dcpkit: second SIGTERM during the emergency save: exiting now\n")
            os._exit(EXIT_KILLED)
        self.signalled_at = time.monotonic()
        os.write(
            2,
            f"dcpkit: SIGTERM on rank {dist.rank()}: saving after this step, then exiting "
            f"({self.timeout_s:.0f}s grace)\n".encode(),
        )
        threading.Thread(target=self._watchdog, daemon=True, name="dcpkit-grace").start()

    def _watchdog(self) -> None:
        if not self._done.wait(self.timeout_s):
            os.write(
                2,
                f"dcpkit: the emergency save did not finish within emergency_timeout_s = "
                f"{self.timeout_s:g}s: exiting\n".encode(),
            )
            os._exit(EXIT_KILLED)

    def agreed(self) -> bool:
        """Whether any rank was signalled (a collective: every rank calls it, every step)."""
        local = self.signalled_at is not None
        if not dist.is_dist():
            return local
        device = "cuda" if torch_dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX)
        return bool(flag.item())

    def finished(self) -> None:
        """The emergency save is durable: the grace timer stops."""
        self._done.set()

    def close(self) -> None:
        self._done.set()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False
