"""The direct DCP reader: stored chunks read straight into their destinations, the same values as
DCP's own reader at any layout, and checksums verified in the same pass."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader

from dcpkit.formats.dcp_reader import DirectFileSystemReader
from dcpkit.safe_pickle import load_metadata, safe_load_planner


def _template(folder):
    """Empty tensors of every stored tensor's full shape (a 1-rank load of any checkpoint)."""
    with open(folder / ".metadata", "rb") as f:
        meta = load_metadata(f, str(folder))
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if hasattr(md, "chunks"):
            out[key] = torch.full(tuple(md.size), 7, dtype=md.properties.dtype)
    return out


def _load(folder, reader, template):
    dcp.load(template, storage_reader=reader, planner=safe_load_planner(), no_dist=True)
    return template


def test_a_2_rank_checkpoint_loads_at_1_rank_as_dcp_reads_it(reference_run):
    step = reference_run / "checkpoint" / "step-20"
    ours = _load(step, DirectFileSystemReader(step, thread_count=3), _template(step))
    theirs = _load(step, FileSystemReader(step), _template(step))
    assert len(ours) > 50
    for key, t in theirs.items():
        assert torch.equal(ours[key], t), key


def test_other_destinations_strided_and_converted(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "rows": torch.randn(64, 33, generator=g),
        "bf16": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "ints": torch.arange(10),
        "empty": torch.empty(0, 4),
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    template = {
        "rows": torch.zeros(33, 64).t(),  # a transposed (non-contiguous) destination
        "bf16": torch.zeros(16, 8, dtype=torch.float32),  # another dtype
        "scalar": torch.tensor(0.0),
        "ints": torch.zeros(10, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    _load(tmp_path, DirectFileSystemReader(tmp_path), template)
    assert torch.equal(template["rows"], state["rows"])
    assert torch.equal(template["bf16"], state["bf16"].float())
    assert template["scalar"].item() == 3.5 and torch.equal(template["ints"], state["ints"])


def _checksums(folder):
    return {
        p.name: xxhash.xxh3_64(p.read_bytes()).hexdigest()
        for p in folder.iterdir()
        if p.name.endswith(".distcp") or p.name == ".metadata"
    }


def test_checksums_verified_in_the_same_pass(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.randn(256, 64, generator=g) for i in range(6)}
    state["step"] = 5  # a byte record between the tensors
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    expected = _checksums(tmp_path)
    reader = DirectFileSystemReader(tmp_path, checksums=expected)
    template = {k: torch.zeros_like(v) for k, v in state.items() if k != "step"}
    template["step"] = 0
    _load(tmp_path, reader, template)
    assert reader.problems == []
    assert all(torch.equal(template[k], state[k]) for k in template if k != "step")
    # Only part of the file needed: the rest is read to be hashed, and still verifies.
    part = DirectFileSystemReader(tmp_path, checksums=expected)
    _load(tmp_path, part, {"w3": torch.zeros(256, 64)})
    assert part.problems == []
    # One flipped byte inside a tensor's data: reported with the file, not raised.
    (data,) = [p for p in tmp_path.iterdir() if p.name.endswith(".distcp")]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    bad = DirectFileSystemReader(tmp_path, checksums=expected)
    _load(tmp_path, bad, {k: torch.zeros(256, 64) for k in template if k != "step"})
    assert [str(p) for p in bad.problems] == [
        f"{data.name}: checksum mismatch: the file's bytes changed after it was written"
    ]
