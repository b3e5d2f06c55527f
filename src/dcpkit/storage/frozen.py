"""Frozen tensors written once per run: a step's file of them is a hard link to the one the
previous save of this process wrote, when nothing in it changed.

A LoRA fine-tune's base model (parameters that do not train) is most of its state; written at
every save it would make each save as large as the base. The engine names the frozen entries of
a save and a token per entry (its shape, dtype and a fingerprint of its content:
``StepInfo.frozen``); the store's DCP writer then writes those entries into files of their own
(``__R_10000.distcp``, ... : still rank R's files to every reader) and, at the next save with
the same entries and tokens, links those files into the new step instead of writing them, with
the same write results (offsets, lengths) in the step's ``.metadata``. Every step stays a whole
checkpoint on its own: deleting one leaves the others' links; its manifest lists the linked
files with their sizes and checksums, as any other.

On an object store the "link" is a copy the store makes (S3's CopyObject: no byte uploaded).
What is linked is checked, never assumed: the file must still be the one this process wrote or
linked (same inode, size and modification time; on a store, same ETag and size) where its last
save published it; anything else (a step deleted or replaced since, a failed save) writes the
entries again.
"""

from __future__ import annotations

import contextlib
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
    files: dict[str, tuple[Any, int, str]]  # name -> (what tells that file, size, digest)
    folder: str  # where the save that holds them is published


_last: dict[tuple[str, str], _Written] = {}
"""Per published folder's parent and rank prefix: the frozen files this process's last save
wrote or linked."""


class FrozenFiles:
    """Mixed into a DCP file system writer (before its ``FileSystemWriter``): the entries named in
    ``frozen`` go to files of their own, linked from the previous save when unchanged. Local
    folders by default (hard links, told apart by inode, size and modification time); a store
    overrides ``frozen_identity`` and ``frozen_link``."""

    frozen: dict[str, str] | None = None
    """Entry -> token of the save being written (set before DCP calls ``write_data``)."""
    final: str | None = None
    """Where the step being written is published (a folder or a URL)."""
    digests: dict[str, tuple[str, int]] | None = None
    """The checksums the manifest takes: a linked file's are put there."""

    def frozen_here(self) -> str:
        """Where the step is being written (a pending folder, published by a rename)."""
        return str(self.path)  # type: ignore[attr-defined]

    def frozen_identity(self, folder: str, name: str) -> Any:
        """What tells ``folder/name`` from another file put in its place (OSError: none)."""
        st = os.stat(Path(folder) / name)
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def frozen_link(self, folder: str, name: str) -> None:
        """``folder/name`` into the step being written, under its name, without writing it."""
        os.link(Path(folder) / name, Path(self.path) / name)  # type: ignore[attr-defined]

    def frozen_unlink(self, name: str) -> None:
        """Undo ``frozen_link`` of ``name`` (before the file is written anew: never through a
        link, which would change the earlier step's file)."""
        (Path(self.path) / name).unlink(missing_ok=True)  # type: ignore[attr-defined]

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        tokens = self.frozen or {}
        mine = [i for i in plan.items if i.index.fqn in tokens]
        if not mine or self.final is None:
            return super().write_data(plan, planner)  # type: ignore[misc]
        from torch.distributed.checkpoint.filesystem import _StoragePrefix
        from torch.futures import Future

        prefix = plan.storage_data.prefix
        key = (str(self.final).rstrip("/").rsplit("/", 1)[0], prefix)
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
        else:  # the next save links this step's own (a store's copy is another object)
            last = _last.pop(key)
            with contextlib.suppress(Exception):  # not told: the next save writes them
                here = self.frozen_here()
                files = {n: (self.frozen_identity(here, n), *f[1:]) for n, f in last.files.items()}
                _last[key] = dataclasses.replace(last, folder=str(self.final), files=files)
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
        linked: list[str] = []
        try:
            if any(self.frozen_identity(last.folder, n) != f[0] for n, f in last.files.items()):
                return None
            for name in last.files:
                self.frozen_link(last.folder, name)
                linked.append(name)
        except Exception:  # gone, another file system, no hard links, no answer: write them
            logger.debug("checkpoint: frozen files of %s not linked", last.folder, exc_info=True)
            for name in linked:
                with contextlib.suppress(Exception):
                    self.frozen_unlink(name)
            return None
        if self.digests is not None:  # the manifest takes their checksums as written
            self.digests.update({n: (f[2], f[1]) for n, f in last.files.items()})
        logger.info(
            "checkpoint: %s of frozen entries linked from %s, not written again",
            human_bytes(sum(f[1] for f in last.files.values())),
            last.folder,
        )
        return list(last.results)

    def _remember(self, key: tuple[str, str], tokens: dict, items: list, results: list) -> None:
        """What the next save needs to link the files just written (nothing, when a file
        cannot be told: that save writes them again)."""
        _last.pop(key, None)
        files = {}
        for name in sorted({r.storage_data.relative_path for r in results}):
            digest, size = (self.digests or {}).get(name, ("", -1))
            try:
                identity = self.frozen_identity(self.frozen_here(), name)
            except Exception:
                return
            if size < 0:  # not hashed as written: nothing to reuse it by
                return
            files[name] = (identity, size, digest)
        _last[key] = _Written(dict(tokens), items, results, files, str(self.final))


def _item_key(item: Any) -> tuple[Any, ...]:
    """What makes two saves' write items of an entry the same: its index, shape and dtype."""
    td = item.tensor_data
    shape = None if td is None else (tuple(td.chunk.offsets), tuple(td.chunk.sizes), td.size)
    dtype = None if td is None else str(td.properties.dtype)
    return (item.index.fqn, tuple(item.index.offset or ()), shape, dtype)
