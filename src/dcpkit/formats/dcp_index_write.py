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
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dcpkit.dist import paused_gc

    paths = md.planner_data if isinstance(md.planner_data, dict) else {}

    def path(fqn: str) -> dict[str, Any]:  # the key's place in the nested state dict
        found = paths.get(fqn)
        return {"p": list(found)} if isinstance(found, tuple | list) else {}

    files: dict[str, int] = {}
    entries: list[dict[str, Any]] = []
    tables = array("q")
    with paused_gc():
        # (fqn, offsets) -> storage: one pass over the entries, without building a
        # MetadataIndex (a dataclass hashed in Python) per chunk
        stored = {(k.fqn, k.offset): v for k, v in (md.storage_data or {}).items()}
        for fqn, tmd in md.state_dict_metadata.items():
            if not isinstance(tmd, TensorStorageMetadata):
                info = stored.get((fqn, None))
                if info is None or getattr(info, "transform_descriptors", None):
                    return None
                f = files.setdefault(info.relative_path, len(files))
                entries.append({"k": fqn, "b": [f, info.offset, info.length], **path(fqn)})
                continue
            if not _plain_properties(tmd.properties):
                return None
            ndim = len(tmd.size)
            rows: list[tuple[Any, Any, Any]] = []
            for chunk in tmd.chunks:
                info = stored.get((fqn, chunk.offsets))
                if info is None or getattr(info, "transform_descriptors", None):
                    return None
                rows.append((chunk.offsets, chunk.sizes, info))
            dim = _sort_dim(rows, ndim)
            if ndim:
                rows.sort(key=lambda r: r[0][dim])
            entries.append(
                {
                    "k": fqn,
                    "dtype": str(tmd.properties.dtype).removeprefix("torch."),
                    "grad": bool(tmd.properties.requires_grad),
                    "size": [int(s) for s in tmd.size],
                    "n": len(rows),
                    "dim": dim,
                    "max": max((r[1][dim] for r in rows), default=0) if ndim else 0,
                    "at": len(tables) * 8,
                    **path(fqn),
                }
            )
            tables.extend([r[0][dim] for r in rows] if ndim else [0] * len(rows))
            for off, sizes, info in rows:
                f = files.get(info.relative_path)
                if f is None:
                    f = files[info.relative_path] = len(files)
                tables.extend(off)
                tables.extend(sizes)
                tables.extend((f, info.offset, info.length))
    if sys.byteorder != "little":
        tables.byteswap()
    header = json.dumps(
        {
            "version": 1,
            "metadata": {"bytes": metadata_size, "xxh3": metadata_xxh3},
            "files": list(files),
            "keys": entries,
            "tables_bytes": len(tables) * 8,
        },
        separators=(",", ":"),
    ).encode()
    pad = b"\0" * (-(len(MAGIC) + 8 + len(header)) % 8)
    return MAGIC + struct.pack("<Q", len(header)) + header + pad + tables.tobytes()


def _sort_dim(rows: list[tuple[Any, Any, Any]], ndim: int) -> int:
    """The dimension with the most distinct chunk offsets (FSDP's rows, or TP's columns)."""
    if ndim == 0 or not rows:
        return 0
    return max(range(ndim), key=lambda d: len({r[0][d] for r in rows}))
