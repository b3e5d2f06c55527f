"""How the generated figures blocks (``benchmarks/figures.py``) write numbers: sizes, ratios,
spans of ratios and seconds, the same on every page."""

from __future__ import annotations

import math
import re
import textwrap

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10


def size(n: float) -> str:
    """GiB with two decimals from 1 GiB, else whole MiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def size3(n: float) -> str:
    """Three significant digits in the largest unit it reaches (KiB, MiB, GiB)."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            return f"{_sig3(n / scale)} {unit}"
    return f"{n:.0f} B"


def seconds(s: float) -> str:
    """Three significant digits, at most three decimals: 0.042 s, 4.25 s, 46.0 s, 473 s."""
    return f"{_sig3(s) if s >= 0.1 else f'{s:.3f}'} s"


def millions(n: float) -> str:
    """A count in millions, three significant digits: 0.14 M, 4.47 M, 35.8 M, 140 M."""
    return f"{_sig3(n / 1e6)} M"


def seconds_span(values: list[float]) -> str:
    """The least and the greatest of some seconds: 0.16-0.17 s."""
    return spread(values, lambda s: seconds(s).removesuffix(" s")) + " s"


def head(*columns: str) -> list[str]:
    """A Markdown table's header row and its separator, one cell per column."""
    return [f"| {' | '.join(columns)} |", "|" + "---|" * len(columns)]


def _sig3(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def span(values: list[float]) -> str:
    """A range of ratios: two decimals; below 0.1, two significant digits of the least."""
    least = min(values)
    places = 2 if least >= 0.1 or least <= 0 else max(2, 1 - math.floor(math.log10(least)))
    low, high = f"{least:.{places}f}", f"{max(values):.{places}f}"
    return f"{low}x" if low == high else f"{low}-{high}x"


def times(x: float) -> str:
    """A ratio: two decimals below 1, one below 10, none above."""
    return f"{x:.2f}" if x < 1 else f"{x:.1f}" if x < 10 else f"{x:.0f}"


def percent(x: float) -> str:
    """A relative cost, signed: +12%."""
    return f"{100 * x:+.0f}%"


def spread(values: list[float], fmt) -> str:  # type: ignore[no-untyped-def]
    """``fmt`` of the least and the greatest, joined: '0.83-0.89' (one value once)."""
    low, high = fmt(min(values)), fmt(max(values))
    if low == high:
        return low
    return f"{low} to {high}" if low.startswith(("+", "-")) else f"{low}-{high}"


_LIST = re.compile(r"\s*([-+*>#|]|\d+[.)])(\s|$)")


def para(text: str, width: int = 96) -> str:
    """``text`` wrapped as one Markdown paragraph: no line may begin like a list item, a
    quote, a heading or a table row (a wrapped '+12%' would start a bullet)."""
    for w in range(width, width - 20, -1):
        lines = textwrap.wrap(text, w, break_long_words=False, break_on_hyphens=False)
        if not any(_LIST.match(line) for line in lines[1:]):
            return "\n".join(lines) + "\n"
    raise ValueError(f"cannot wrap without a line that starts a list: {text[:60]!r}")
