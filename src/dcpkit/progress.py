"""Progress bars for long operations: on stderr, shown only when stderr is a terminal (quiet in
logs and CI)."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress(total: int, desc: str, unit: str = "B") -> tqdm:
    """A bar of ``total`` bytes (``unit="B"``, scaled) or items, hidden off a terminal."""
    return tqdm(
        total=total,
        unit=unit,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        desc=desc,
        file=sys.stderr,
        disable=not sys.stderr.isatty(),
        leave=False,
    )
