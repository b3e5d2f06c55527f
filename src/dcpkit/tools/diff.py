"""``dcpkit diff``: compare two checkpoints tensor by tensor, across formats.

Two checkpoints of the same format are compared by key. A DCP checkpoint against a Hugging Face
folder goes through the family's key map and transforms (the HF side is mapped back to
TorchTitan names and layout), so a checkpoint and its own export compare equal.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dcpkit.convert.adapters import get_adapter
from dcpkit.convert.adapters.base import infer_family
from dcpkit.convert.common import DEFAULT_BUDGET, max_abs_diff, row_blocks
from dcpkit.convert.views import FromHF
from dcpkit.formats.blocks import recycled_blocks
from dcpkit.formats.sources import HF, open_source
from dcpkit.formats.structure import refuse_broken
from dcpkit.layout import is_model_key
from dcpkit.readers import held_view


@dataclass
class TensorDiff:
    name: str
    max_abs_diff: float
    equal: bool


@dataclass
class DiffResult:
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)  # shape or dtype
    tensors: list[TensorDiff] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def differing(self, atol: float) -> list[TensorDiff]:
        return [t for t in self.tensors if t.max_abs_diff > atol]

    def same(self, atol: float) -> bool:
        return not (self.only_a or self.only_b or self.changed or self.differing(atol))


class _Mapped:
    """An HF folder seen through a family adapter: TorchTitan names, TorchTitan layout."""

    def __init__(self, source: Any, family: str) -> None:
        self.source = source
        adapter = get_adapter(family)
        config = source.config()
        if config is None:
            raise ValueError(
                f"{_where(source)} has no config.json; cannot map it to {family} names"
            )
        args = adapter.args_from_hf_config(config)
        plan = adapter.plan_from_hf(
            {k: source.shape(k) for k in source.names()},
            args,
            adapter.flavor_name(args) or "custom",
            _where(source),
        )
        self.view = FromHF(source, plan)
        self.canonical = adapter.canonical

    def names(self) -> list[str]:
        return self.view.names()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.view.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.view.dtype(name)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.view.read(name, rows)

    def row_block(self, name: str) -> int:
        return self.view.row_block(name)


def diff_paths(
    a: str | Path,
    b: str | Path,
    family: str | None = None,
    budget: int = DEFAULT_BUDGET,
    storage_options: dict[str, Any] | None = None,
    trust_pickle: bool = False,
) -> DiffResult:
    """Compare every tensor of ``a`` and ``b``, folders, files or URLs (row block by row
    block: bounded memory; a remote checkpoint is read in place). ``family``: the key map
    between a checkpoint and a Hugging Face folder; None infers it (from the checkpoint's
    parameter names and the folder's ``config.json``) and says so in the notes."""
    with (
        held_view(a, storage_options, purpose="diff") as va,
        held_view(b, storage_options, purpose="diff") as vb,
    ):
        for view in (va, vb):
            refuse_broken(view)
        sa, sb = (open_source(v.path, v.opener, trust_pickle) for v in (va, vb))
        sa.location, sb.location = va.location, vb.location  # a URL, not its local stand-in
        return _diff(
            sa,
            sb,
            family,
            budget,
        )


def _where(source: Any) -> str:
    """What to call ``source`` in messages: its path or URL as given."""
    return str(getattr(source, "location", None) or source.path)


def _diff(sa: Any, sb: Any, family: str | None, budget: int) -> DiffResult:
    result = DiffResult()
    try:
        left, right = sa, sb
        names_a, names_b = list(sa.names()), list(sb.names())
        if (sa.kind == HF) != (sb.kind == HF):
            hf, other = (sa, sb) if sa.kind == HF else (sb, sa)
            model_key = getattr(other, "is_model_key", is_model_key)
            keep = [n for n in other.names() if model_key(n)]
            if family is None:
                family, why = infer_family(hf.config(), keep)
                result.notes.append(f"model family {family}: {why} (--model to choose another)")
            mapped = _Mapped(hf, family)
            skipped = len(other.names()) - len(keep)
            if skipped:
                result.notes.append(
                    f"{skipped} non-model tensors (optimizer, ...) of "
                    f"{_where(other)} are not compared with a Hugging Face folder"
                )
            # Compare in canonical TorchTitan spelling (either TorchTitan dialect matches).
            canon = {mapped.canonical(n): n for n in keep}
            if sa.kind == HF:
                left, names_a = mapped, mapped.names()
                right, names_b = _Renamed(other, canon), list(canon)
            else:
                left, names_a = _Renamed(other, canon), list(canon)
                right, names_b = mapped, mapped.names()
        set_b = set(names_b)
        result.only_a = sorted(n for n in names_a if n not in set_b)
        result.only_b = sorted(n for n in names_b if n not in set(names_a))
        for name in names_a:
            if name not in set_b:
                continue
            sha, shb = tuple(left.shape(name)), tuple(right.shape(name))
            dta, dtb = left.dtype(name), right.dtype(name)
            if sha != shb or dta != dtb:
                result.changed.append(
                    f"{name}: {list(sha)} {str(dta).removeprefix('torch.')} -> "
                    f"{list(shb)} {str(dtb).removeprefix('torch.')}"
                )
                if sha != shb:
                    continue
            block = max(
                getattr(left, "row_block", lambda n: 1)(name),
                getattr(right, "row_block", lambda n: 1)(name),
            )
            worst, equal = 0.0, True
            with recycled_blocks():
                for rows in row_blocks(sha, max(dta.itemsize, dtb.itemsize), budget, block):
                    x, y = left.read(name, rows), right.read(name, rows)
                    equal &= torch.equal(x, y) if dta == dtb else False
                    worst = max(worst, max_abs_diff(x, y))
                    del x, y  # their buffers serve the next block
            result.tensors.append(TensorDiff(name, worst, equal))
    finally:
        sa.close()
        sb.close()
    return result


class _Renamed:
    def __init__(self, source: Any, canon: dict[str, str]) -> None:
        self.source, self.canon = source, canon

    def shape(self, name: str) -> tuple[int, ...]:
        return self.source.shape(self.canon[name])

    def dtype(self, name: str) -> torch.dtype:
        return self.source.dtype(self.canon[name])

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return self.source.read(self.canon[name], rows)


def diff_lines(result: DiffResult, atol: float) -> list[str]:
    """What ``dcpkit diff`` prints: notes, what differs, and a summary line."""
    lines = [f"note: {note}" for note in result.notes]
    lines += [f"only in A: {name}" for name in result.only_a]
    lines += [f"only in B: {name}" for name in result.only_b]
    lines += [f"changed:   {change}" for change in result.changed]
    differing = result.differing(atol)
    lines += [f"differs:   {t.name}  max |a - b| = {t.max_abs_diff:.6g}" for t in differing]
    equal = sum(t.equal for t in result.tensors)
    close = len(result.tensors) - equal - len(differing)
    lines.append(
        f"{len(result.tensors)} tensors compared: {equal} identical, {close} within atol "
        f"{atol:g}, {len(differing)} differ; {len(result.only_a)} only in A, "
        f"{len(result.only_b)} only in B, {len(result.changed)} changed shape or dtype"
    )
    return lines
