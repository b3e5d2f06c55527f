"""Crafted checkpoint folders: a real dcpkit checkpoint whose ``.metadata`` is edited as anyone
handing over a folder could, with its index rebuilt and its manifest's sizes, checksums and seal
recomputed, so that nothing but the structure itself tells that it cannot hold. Each case says
the key it breaks and the rule a verdict must name."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from dcpkit.formats.dcp_index_write import encode_index
from dcpkit.manifest import CHECKSUM_ALGORITHM, SEAL, sealed_bytes


@dataclass
class Case:
    name: str
    rule: str  # a phrase the refusal must contain
    change: Callable[[Any, str], None]  # (metadata, key) -> None


def _tensor(md: Any, key: str) -> Any:
    return md.state_dict_metadata[key]


def _storage(md: Any, key: str) -> list[Any]:
    return [k for k in md.storage_data if k.fqn == key]


def _negative_offset(md: Any, key: str) -> None:
    for k in _storage(md, key):
        md.storage_data[k].offset = -100


def _huge(md: Any, key: str) -> None:  # 32 TiB declared, the 2 KB record unchanged
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    tmd = _tensor(md, key)
    size = torch.Size([1 << 40, tmd.size[1]])
    old = tmd.chunks[0]
    tmd.size = size
    tmd.chunks[0] = ChunkStorageMetadata(old.offsets, size)


def _doubled(md: Any, key: str) -> None:  # a [2n, m] tensor backed by its [n, m] record
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    tmd = _tensor(md, key)
    size = torch.Size([tmd.size[0] * 2, tmd.size[1]])
    old = tmd.chunks[0]
    tmd.size = size
    tmd.chunks[0] = ChunkStorageMetadata(old.offsets, size)
    # the storage entry stays the same (it is keyed by the chunk's offsets)
    assert MetadataIndex(key, old.offsets) in md.storage_data


def _past_end(md: Any, key: str) -> None:
    for k in _storage(md, key):
        md.storage_data[k].offset += 1 << 30


def _overlap(md: Any, key: str) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    tmd = _tensor(md, key)
    old = tmd.chunks[0]
    rows = tmd.size[0] // 2
    tmd.chunks[0] = ChunkStorageMetadata(old.offsets, torch.Size([rows + 1, tmd.size[1]]))
    second = torch.Size([rows, 0])
    tmd.chunks.append(ChunkStorageMetadata(second, torch.Size([tmd.size[0] - rows, tmd.size[1]])))
    info = md.storage_data[MetadataIndex(key, old.offsets)]
    md.storage_data[MetadataIndex(key, second)] = info


def _negative_size(md: Any, key: str) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    tmd = _tensor(md, key)
    size = torch.Size([-tmd.size[0], tmd.size[1]])
    tmd.size = size
    tmd.chunks[0] = ChunkStorageMetadata(tmd.chunks[0].offsets, size)


def _wider(md: Any, key: str) -> None:  # the record's shape, rows and columns swapped
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    tmd = _tensor(md, key)
    size = torch.Size([tmd.size[1], tmd.size[0]])
    tmd.size = size
    tmd.chunks[0] = ChunkStorageMetadata(tmd.chunks[0].offsets, size)


def _dtype(md: Any, key: str) -> None:
    tmd = _tensor(md, key)
    tmd.properties.dtype = torch.float64


def _short_length(md: Any, key: str) -> None:  # the record cut to its first half
    for k in _storage(md, key):
        md.storage_data[k].length //= 2


def _negative_length(md: Any, key: str) -> None:
    for k in _storage(md, key):
        md.storage_data[k].length = -8


def _transforms(names: object) -> Callable[[Any, str], None]:
    def change(md: Any, key: str) -> None:  # the record's bytes said to be transformed
        for k in _storage(md, key):
            md.storage_data[k].transform_descriptors = names

    return change


CASES = [
    Case("negative-offset", "negative offset", _negative_offset),
    Case("huge", "record holds", _huge),
    Case("doubled", "record holds", _doubled),
    Case("past-end", "too short for", _past_end),
    Case("overlap", "overlap", _overlap),
    Case("negative-size", "negative size", _negative_size),
    Case("transposed", "record holds", _wider),
    Case("dtype", "record holds", _dtype),
    Case("cut-record", "not a readable torch.save record", _short_length),
    Case("negative-length", "negative length", _negative_length),
    # DCP's compression, in a step dcpkit wrote (which transforms nothing); garbled; unknown
    Case("zstd-in-a-dcpkit-step", "is stored with transforms", _transforms(["stream.zstd/1"])),
    Case("garbled-transform", "is stored with transforms", _transforms(["stream.zstd"])),
    Case("unknown-transform", "is stored with transforms", _transforms(["made.up/1"])),
]


def craft(step: Path, case: Case, key: str, index: bool = True) -> None:
    """Apply ``case`` to ``key`` of checkpoint folder ``step`` and make the folder agree with
    itself again: the index rebuilt from the edited ``.metadata`` (or, without ``index``,
    removed: as DCP and TorchTitan write none), the manifest's entries and seal recomputed."""
    md = pickle.loads((step / ".metadata").read_bytes())
    case.change(md, key)
    data = pickle.dumps(md)
    (step / ".metadata").write_bytes(data)
    digest = xxhash.xxh3_64_hexdigest(data)
    manifest = json.loads((step / "dcpkit.json").read_text())
    files = manifest["files"]
    files[".metadata"] = {"size": len(data), CHECKSUM_ALGORITHM: digest}
    index = encode_index(md, len(data), digest) if index else None
    if index is None:
        (step / ".metadata.index").unlink(missing_ok=True)
        files.pop(".metadata.index", None)
    else:
        (step / ".metadata.index").write_bytes(index)
        files[".metadata.index"] = {
            "size": len(index),
            CHECKSUM_ALGORITHM: xxhash.xxh3_64_hexdigest(index),
        }
    manifest.pop(SEAL, None)
    (step / "dcpkit.json").write_bytes(sealed_bytes(manifest))


def hostile_markers(checkpoint: Path, step: int) -> None:
    """Every marker kind in ``checkpoint/.dcpkit-holds`` as a FIFO (the step kinds naming
    ``step``, the newest: a claim that it is being deleted, or kept past retention), a link to
    /dev/zero and a 1 GiB sparse file: none may be opened, read whole or obeyed."""
    import os

    holds = checkpoint / ".dcpkit-holds"
    holds.mkdir()
    for kind in ("hold-{}.json", f"deleting-step-{step}{{}}.json", f"kept-step-{step}{{}}.json"):
        os.mkfifo(holds / kind.format(""))
        os.symlink("/dev/zero", holds / kind.format("-zero"))
        with open(holds / kind.format("-sparse"), "wb") as f:
            f.truncate(1 << 30)
