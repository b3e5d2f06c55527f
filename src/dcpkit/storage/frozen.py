"""Frozen tensors written once per run: a step's file of them is a hard link to the one the
previous save of this process wrote, when nothing in it changed.

A LoRA fine-tune's base model (parameters that do not train) is most of its state; written at
every save it would make each save as large as the base. The engine names the frozen entries of
a save and a token per entry that changes whenever the tensor does (``StepInfo.frozen``); the
local store's DCP writer then writes those entries into files of their own
(``__R_<FROZEN_FILE>N.distcp``, still rank R's files to every reader) and, at the next save
with the same entries and tokens, links those files into the new step instead of writing them,
with the same write results (offsets, lengths) in the step's ``.metadata``. Every step stays a
whole checkpoint on its own: deleting one leaves the others' links; its manifest lists the
linked files with their sizes and checksums, as any other.

What is linked is checked, never assumed: the file must still be the one this process wrote or
linked (same inode, size and modification time) in the folder its last save published;
anything else (a step deleted or replaced since, a failed save) writes the entries again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from dcpkit.units import human_bytes

logger = logging.getLogger(__name__)

FROZEN_FILE = 10000
"""The first file number of a rank's frozen files: ``__R_10000.distcp``, far above the files a
rank's writer threads number from 0."""


@dataclasses.dataclass
class _Written:
    tokens: dict[str, str]
    items: list[tuple[Any, ...]]
    results: list[Any]
    files: dict[str, tuple[tuple[int, int, int], str]]  # name -> ((inode, size, mtime), digest)
    folder: Path  # where the save that holds them is published


_last: dict[tuple[str, str], _Written] = {}
"""Per published folder's parent and rank prefix: the frozen files this process's last save
wrote or linked."""


class FrozenFiles:
    """Mixed into a file system DCP writer (before ``FileSystemWriter``): the entries named in
    ``frozen`` go to files of their own, linked from the previous save when unchanged."""

    frozen: dict[str, str] | None = None
    """Entry -> token of the save being written (set before DCP calls ``write_data``)."""
    final: Path | None = None
    """The folder the step being written is published as."""

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        tokens = self.frozen or {}
        mine = [i for i in plan.items if i.index.fqn in tokens]
        if not mine or self.final is None:
            return super().write_data(plan, planner)  # type: ignore[misc]
        from torch.distributed.checkpoint.filesystem import _StoragePrefix
        from torch.futures import Future

        prefix = plan.storage_data.prefix
        key = (str(self.final.parent), prefix)
        items = [_item_key(i) for i in mine]
        frozen_results = self._link(_last.get(key), tokens, items)
        if frozen_results is None:
            own = dataclasses.replace(
                plan, items=mine, storage_data=_StoragePrefix(f"{prefix}{FROZEN_FILE // 10}")
            )
            written = super().write_data(own, planner)  # type: ignore[misc]
            written.wait()
            frozen_results = list(written.value())
            self._remember(key, tokens, items, frozen_results)
        else:
            _last[key] = dataclasses.replace(_last[key], folder=self.final)
        rest = dataclasses.replace(plan, items=[i for i in plan.items if i.index.fqn not in tokens])
        others = super().write_data(rest, planner)  # type: ignore[misc]
        others.wait()
        out: Any = Future()
        out.set_result(frozen_results + list(others.value()))
        return out

    def _link(self, last: _Written | None, tokens: dict[str, str], items: list) -> list | None:
        """Link the previous save's frozen files into this step; their write results, or None
        when they cannot be reused (anything changed, or a file is not the one written)."""
        if last is None or last.tokens != tokens or last.items != items:
            return None
        here = Path(self.path)  # type: ignore[attr-defined]
        for name, (identity, _) in last.files.items():
            try:
                if _identity(os.stat(last.folder / name)) != identity:
                    return None
            except OSError:
                return None
        linked = []
        try:
            for name in last.files:
                os.link(last.folder / name, here / name)
                linked.append(name)
        except OSError:  # another file system, or no hard links: write them again
            for name in linked:
                (here / name).unlink(missing_ok=True)
            return None
        digests = getattr(getattr(self, "fs", None), "digests", None)
        if digests is not None:  # the manifest takes their checksums as written
            digests.update({n: (digest, ident[1]) for n, (ident, digest) in last.files.items()})
        logger.info(
            "checkpoint: %s of frozen entries linked from %s, not written again",
            human_bytes(sum(ident[1] for ident, _ in last.files.values())),
            last.folder,
        )
        return list(last.results)

    def _remember(self, key: tuple[str, str], tokens: dict, items: list, results: list) -> None:
        here = Path(self.path)  # type: ignore[attr-defined]
        digests = getattr(getattr(self, "fs", None), "digests", None) or {}
        files = {}
        for name in sorted({r.storage_data.relative_path for r in results}):
            st = os.stat(here / name)
            digest, size = digests.get(name, ("", -1))
            if size != st.st_size:  # not hashed as written: nothing to reuse it by
                _last.pop(key, None)
                return
            files[name] = (_identity(st), digest)
        assert self.final is not None
        _last[key] = _Written(dict(tokens), items, results, files, self.final)


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    """What tells the file written from another one put in its place: inode, size, mtime."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _item_key(item: Any) -> tuple[Any, ...]:
    """What makes two saves' write items of an entry the same: its index, shape and dtype."""
    td = item.tensor_data
    shape = None if td is None else (tuple(td.chunk.offsets), tuple(td.chunk.sizes), td.size)
    dtype = None if td is None else str(td.properties.dtype)
    return (item.index.fqn, tuple(item.index.offset or ()), shape, dtype)
