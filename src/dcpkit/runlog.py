"""A run's ``metrics.jsonl`` read back: the last record of each step and the run's events (the
format is described in ``dcpkit.train.metrics``, which writes it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


@dataclass
class Run:
    """A run's ``metrics.jsonl``, read back: the last record of each step, and the events."""

    path: Path
    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.parent.name

    def starts(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "start"]

    def saves(self) -> dict[int, dict[str, Any]]:
        """The last save event of each step."""
        return {e["step"]: e for e in self.events if e.get("event") == "save"}

    def config(self) -> dict[str, Any]:
        starts = self.starts()
        return starts[-1].get("config", {}) if starts else {}


def read_run(path: str | Path) -> Run:
    """Read a run folder's ``metrics.jsonl`` (or that file itself). A line that is not a JSON
    object (a run killed mid-write leaves a partial last line) is an error naming the file and
    line, except a partial last line, which is skipped."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; pass a run's dump folder (the one holding {METRICS_FILE})"
        )
    run = Run(path)
    lines = path.read_text(errors="replace").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # cut off by a crash while it was written
            raise ValueError(f"{path}:{number} is not a JSON record") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number} is not a JSON object")
        if "event" in record:
            run.events.append(record)
        elif isinstance(record.get("step"), int) and "loss" in record:
            run.steps[record["step"]] = record
        else:
            raise ValueError(f"{path}:{number} is neither a step record nor an event")
    return run
