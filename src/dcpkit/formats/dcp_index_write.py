"""Writing the per-key index of a DCP ``.metadata`` that ``dcp_index.DcpIndex`` reads (its
layout is described there)."""

from __future__ import annotations

import json
import struct
import sys
from array import array
from typing import Any

from dcpkit.formats.dcp_index import MAGIC, _plain_properties


def encode_index(md: Any, metadata_size: int, metadata_xxh3: str) -> bytes | None:
    """The index of ``md`` (a ``.metadata`` of ``metadata_size`` bytes with that checksum); None
    when it holds what the index does not express (storage transforms, a chunk without storage,
    a tensor of another layout): such a checkpoint is loaded from its ``.metadata``."""
    from dcpkit.dist import paused_gc

    index = IndexBuilder(md.planner_data)
    with paused_gc():
        if not index.add_entries(md.state_dict_metadata, md.storage_data or {}):
            return None
    return index.encode(metadata_size, metadata_xxh3)


def stored_plainly(info: Any) -> bool:
    """Whether a storage entry exists and holds its bytes as they are (no transforms, such as
    compression: the index cannot express them; older torch has no such field)."""
    return info is not None and not getattr(info, "transform_descriptors", None)


class IndexBuilder:
    """The index, key by key (a streamed ``.metadata``'s writer adds each tensor as it goes)."""

    def __init__(self, planner_data: Any) -> None:
        self.paths = planner_data if isinstance(planner_data, dict) else {}
        self.files: dict[str, int] = {}
        self.entries: list[dict[str, Any]] = []
        self.tables = bytearray()  # little-endian int64s, a tensor's appended at a time

    def _path(self, fqn: str) -> dict[str, Any]:  # the key's place in the nested state dict
        found = self.paths.get(fqn)
        return {"p": list(found)} if isinstance(found, tuple | list) else {}

    def add_entries(self, entries: dict[str, Any], storage: dict[Any, Any]) -> bool:
        """Every key of ``entries`` (a ``state_dict_metadata``) with its chunks' places in
        ``storage`` (a ``storage_data``); False at the first the index cannot express."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        # (fqn, offsets) -> storage: one pass over the entries, without building a
        # MetadataIndex (a dataclass hashed in Python) per chunk
        stored = {(k.fqn, k.offset): v for k, v in storage.items()}
        for fqn, tmd in entries.items():
            if not isinstance(tmd, TensorStorageMetadata):
                if not self.add_object(fqn, stored.get((fqn, None))):
                    return False
                continue
            rows = []
            for chunk in tmd.chunks:
                info = stored.get((fqn, chunk.offsets))
                if not stored_plainly(info):
                    return False
                rows.append(
                    (chunk.offsets, chunk.sizes, info.relative_path, info.offset, info.length)
                )
            if not self.add_tensor(fqn, tmd, rows):
                return False
        return True

    def add_object(self, fqn: str, info: Any) -> bool:
        if not stored_plainly(info):
            return False
        f = self.files.setdefault(info.relative_path, len(self.files))
        self.entries.append({"k": fqn, "b": [f, info.offset, info.length], **self._path(fqn)})
        return True

    def add_tensor(self, fqn: str, tmd: Any, rows: list[tuple[Any, ...]]) -> bool:
        """``rows``: per chunk (offsets, sizes, file, offset, length)."""
        if not _plain_properties(tmd.properties):
            return False
        ndim = len(tmd.size)
        dim = _sort_dim(rows, ndim)
        if ndim:
            rows.sort(key=lambda r: r[0][dim])
        tables, files = array("q"), self.files
        self.entries.append(
            {
                "k": fqn,
                "dtype": str(tmd.properties.dtype).removeprefix("torch."),
                "grad": bool(tmd.properties.requires_grad),
                "size": [int(s) for s in tmd.size],
                "n": len(rows),
                "dim": dim,
                "max": max((r[1][dim] for r in rows), default=0) if ndim else 0,
                "at": len(self.tables),
                **self._path(fqn),
            }
        )
        tables.extend([r[0][dim] for r in rows] if ndim else [0] * len(rows))
        for off, sizes, path, offset, length in rows:
            f = files.get(path)
            if f is None:
                f = files[path] = len(files)
            tables.extend(off)
            tables.extend(sizes)
            tables.extend((f, offset, length))
        if sys.byteorder != "little":
            tables.byteswap()
        self.tables += memoryview(tables).cast("B")
        return True

    def encode(self, metadata_size: int, metadata_xxh3: str) -> bytes:
        """The index; its tables are not copied (the header is put in front of them)."""
        tables, self.tables = self.tables, bytearray()
        header = json.dumps(
            {
                "version": 1,
                "metadata": {"bytes": metadata_size, "xxh3": metadata_xxh3},
                "files": list(self.files),
                "keys": self.entries,
                "tables_bytes": len(tables),
            },
            separators=(",", ":"),
        ).encode()
        pad = b"\0" * (-(len(MAGIC) + 8 + len(header)) % 8)
        tables[0:0] = MAGIC + struct.pack("<Q", len(header)) + header + pad
        return tables if len(tables) >= 1 << 26 else bytes(tables)  # type: ignore[return-value]


def _sort_dim(rows: list[tuple[Any, Any, Any]], ndim: int) -> int:
    """The dimension with the most distinct chunk offsets (FSDP's rows, or TP's columns)."""
    if ndim == 0 or not rows:
        return 0
    return max(range(ndim), key=lambda d: len({r[0][d] for r in rows}))
