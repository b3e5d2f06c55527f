"""Sizes for people: parsing ``5GB`` and printing ``1.5 GiB``."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal units, as transformers; ``GiB`` is binary)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    units = {
        "KIB": 1 << 10,
        "MIB": 1 << 20,
        "GIB": 1 << 30,
        "TIB": 1 << 40,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "B": 1,
    }
    for unit, factor in units.items():
        if s.endswith(unit):
            number = s[: -len(unit)].strip()
            try:
                return int(float(number) * factor)
            except ValueError:
                break
    try:
        return int(s)
    except ValueError:
        raise ValueError(f"size {text!r} is not a size like 5GB, 500MB or 2GiB") from None
