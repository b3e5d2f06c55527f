"""``.metadata`` read into arrays by the tools that only look at it (``formats.metadata_arrays``):
what DCP's unpickler reads, every check on it the same, in memory a small multiple of the
chunks' integers."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys

import pytest
import torch
from tests.conftest import ROOT, cli
from tests.test_described import _streamed_case

from dcpkit.formats.metadata_arrays import ArrayMetadata, read_bounded, read_metadata_arrays
from dcpkit.safe_pickle import UnsafeCheckpoint, load_metadata


def _same(md, arrays) -> None:
    assert list(md.state_dict_metadata) == list(arrays.state_dict_metadata)
    for key, entry in md.state_dict_metadata.items():
        assert arrays.state_dict_metadata[key] == entry, key
    assert set(md.storage_data) == set(arrays.storage_data)
    for index, info in md.storage_data.items():
        assert index in arrays.storage_data and arrays.storage_data[index] == info
    assert md.planner_data == arrays.planner_data and md.version == arrays.version


def test_arrays_read_what_dcps_unpickler_reads():
    """A streamed ``.metadata`` (dcpkit's first saves) and DCP's own pickle of the same
    ``Metadata``: the arrays give back every entry and storage entry the unpickler gives."""
    streamed, compacted, want = _streamed_case()
    out = io.BytesIO()
    streamed.write_streamed(out, compacted, None, "1.0.0")
    for data in (out.getvalue(), pickle.dumps(want)):
        arrays = read_metadata_arrays(io.BytesIO(data), ".metadata")
        assert isinstance(arrays, ArrayMetadata)
        _same(load_metadata(io.BytesIO(data), ".metadata"), arrays)
        assert arrays.chunks_read == sum(
            len(getattr(e, "chunks", ())) for e in want.state_dict_metadata.values()
        )


def test_what_the_arrays_cannot_take_is_read_whole_or_refused(tmp_path):
    """A chunk shared through the pickle's memo (one object in two places) has no place in the
    arrays: a small file is read whole, whose verdict stands; a large one is refused, named."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    chunk = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 4]))
    props = TensorProperties(torch.float32)
    md = Metadata(
        {"w": TensorStorageMetadata(props, torch.Size([2, 4]), [chunk, chunk])},
        storage_data={MetadataIndex("w", [0, 0]): _StorageInfo("__0_0.distcp", 0, 100)},
    )
    data = pickle.dumps(md)
    with pytest.raises(UnsafeCheckpoint, match=r"x/\.metadata cannot be read \(a tensor's chunk"):
        read_metadata_arrays(io.BytesIO(data), "x/.metadata")
    whole = read_bounded(io.BytesIO(data), "x/.metadata")
    assert not isinstance(whole, ArrayMetadata) and len(whole.state_dict_metadata["w"].chunks) == 2
    big = io.BytesIO(data + b"\0" * (65 << 20))  # past what is read whole
    with pytest.raises(UnsafeCheckpoint, match="a tensor's chunk list"):
        read_bounded(big, "x/.metadata")
    # code in a file is refused before anything is built, as by the unpickler
    chunk_class = b"ctorch.distributed.checkpoint.metadata\nChunkStorageMetadata\n"
    hostile = pickle.dumps(md, protocol=2).replace(chunk_class, b"cos\nsystem\n")
    assert hostile != pickle.dumps(md, protocol=2)
    with pytest.raises(UnsafeCheckpoint, match=r"x/\.metadata asks to load os\.system"):
        read_metadata_arrays(io.BytesIO(hostile), "x/.metadata")


def test_verify_and_inspect_read_arrays_and_find_what_they_found(reference_run):
    """``verify``, ``list`` and ``inspect`` take the arrays (a load takes DCP's objects); a
    checkpoint they pass still passes, its chunks counted as before."""
    step = sorted(reference_run.glob("checkpoint/step-*"))[-1]
    with open(step / ".metadata", "rb") as f:
        assert isinstance(read_bounded(f, ".metadata"), ArrayMetadata)
    assert cli("verify", str(step)).returncode == 0
    shown = json.loads(cli("inspect", str(step), "--json").stdout)
    with open(step / ".metadata", "rb") as f:
        md = load_metadata(f, ".metadata")
    shards = {k: len(e.chunks) for k, e in md.state_dict_metadata.items() if hasattr(e, "chunks")}
    assert {t["name"]: t["shards"] for t in shown["tensors"]} == shards


def test_a_large_metadata_is_checked_in_bounded_memory():
    """The scale benchmark's 405B first save at 128 ranks (0.37 M chunks, streamed as dcpkit
    writes it): ``verify``'s checks on the arrays, each in a process of its own, beside the same
    checks on DCP's objects - a fraction of the memory, within 320 bytes a chunk."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "planning_scale.py"), "--_cell"]
    proc = subprocess.run([*cmd, "405B:128:1:described-verify"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    r = json.loads(line[len("RESULT ") :])
    chunks = r["verify_chunks"]
    assert chunks >= r["described_chunks"] > 300_000
    arrays = r["verify_peak_bytes"] - r["verify_start_bytes"]
    whole = r["verify_whole_peak_bytes"] - r["verify_start_bytes"]
    # about 160 bytes a chunk at 16.6 M chunks (docs/scale.md); here the fixed costs weigh more
    assert arrays < 320 * chunks and arrays < whole / 3, (arrays, whole, chunks)
    assert r["verify_arrays_bytes"] < 100 * chunks
