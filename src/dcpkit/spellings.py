"""The spellings TorchTitan has used for the same parameter, one table per model family (the
conversions' adapters map each to its canonical name; a load matches them too). TorchTitan 0.3
names Llama's attention projections ``attention.qkv_linear.wq`` where earlier releases (and
``dcpkit from-hf``, and dcpkit's reference trainer) write ``attention.wq``; a checkpoint of
either spelling starts a model of the other."""

from __future__ import annotations

import re
from collections.abc import Iterable

LLAMA3_ALIASES: dict[str, str] = {
    "layers.{i}.attention.qkv_linear.wq.weight": "layers.{i}.attention.wq.weight",
    "layers.{i}.attention.qkv_linear.wk.weight": "layers.{i}.attention.wk.weight",
    "layers.{i}.attention.qkv_linear.wv.weight": "layers.{i}.attention.wv.weight",
    "lm_head.weight": "output.weight",
}
QWEN3_ALIASES: dict[str, str] = {
    **LLAMA3_ALIASES,
    "layers.{i}.attention.qkv_linear.q_norm.weight": "layers.{i}.attention.q_norm.weight",
    "layers.{i}.attention.qkv_linear.k_norm.weight": "layers.{i}.attention.k_norm.weight",
}
MOE_ALIASES: dict[str, str] = {
    # TorchTitan's newer names carry the dimension order of the stacked experts.
    "layers.{i}.moe.experts.w1_EFD": "layers.{i}.moe.experts.w1",
    "layers.{i}.moe.experts.w2_EDF": "layers.{i}.moe.experts.w2",
    "layers.{i}.moe.experts.w3_EFD": "layers.{i}.moe.experts.w3",
    "lm_head.weight": "output.weight",
}
_TABLES = (LLAMA3_ALIASES, QWEN3_ALIASES, {**QWEN3_ALIASES, **MOE_ALIASES}, MOE_ALIASES)


def _compiled(table: dict[str, str]) -> list[tuple[re.Pattern[str], str]]:
    out = []
    for pattern, target in table.items():
        body = re.escape(pattern).replace(r"\{i\}", r"(?P<i>\d+)")
        out.append((re.compile("^" + body + "$"), target))
    return out


_COMPILED = [_compiled(t) for t in _TABLES]


def _canonical(key: str, table: list[tuple[re.Pattern[str], str]]) -> str:
    for regex, target in table:
        m = regex.match(key)
        if m:
            return target.replace("{i}", m.group("i")) if "{i}" in target else target
    return key


def other_spellings(missing: Iterable[str], saved: set[str]) -> dict[str, str]:
    """For each of ``missing`` (names the loader wants and the checkpoint lacks), the saved
    name one family's table spells the same, when every one of them has exactly one; else
    empty (the load then refuses, naming what is missing)."""
    missing = list(missing)
    for table in _COMPILED:
        by_canonical: dict[str, list[str]] = {}
        for key in saved:
            by_canonical.setdefault(_canonical(key, table), []).append(key)
        found = {k: by_canonical.get(_canonical(k, table), []) for k in missing}
        if all(len(v) == 1 and v[0] != k for k, v in found.items()):
            return {k: v[0] for k, v in found.items()}
    return {}
