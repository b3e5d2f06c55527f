"""The index of ``.metadata`` dcpkit writes at every save: a rank's load finds its chunks in it
by binary search, exactly the ones that overlap its shards; an index that is damaged, hostile,
stale or untrue is an error naming it, never a wrong load."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from conftest import cli
from dcpkit import CheckpointConfig, CheckpointManager
from dcpkit.errors import CheckpointError
from dcpkit.formats.dcp_index import DcpIndex
from dcpkit.formats.dcp_index_write import encode_index
from dcpkit.manifest import CHECKSUM_ALGORITHM, SEAL, sealed_bytes
from dcpkit.safe_pickle import UnsafeCheckpoint


def _grid(shape: list[int], cuts: list[list[int]]) -> list[tuple[list[int], list[int]]]:
    """Chunks of ``shape`` cut at the given offsets per dimension (a grid, as FSDP x TP)."""
    spans = [[(a, b - a) for a, b in zip([0, *c], [*c, s])] for c, s in zip(cuts, shape)]
    return [([o for o, _ in combo], [n for _, n in combo]) for combo in itertools.product(*spans)]


LAYOUTS = {
    "rows": ([64, 16], [[8, 16, 24, 32, 40, 48, 56], []]),
    "grid": ([64, 32], [[16, 32, 48], [8, 16, 24]]),
    "columns": ([16, 64], [[], [8, 16, 24, 32, 40, 48, 56]]),
    "uneven": ([33, 4], [[10, 20, 30, 33], []]),  # the last chunk is empty
    "cube": ([6, 6, 6], [[3], [2, 4], [3]]),
    "scalar": ([], []),
}


def _metadata(drop: tuple[str, int] | None = None) -> Metadata:
    state: dict = {}
    storage: dict = {}
    offset = 0
    for fqn, (shape, cuts) in LAYOUTS.items():
        chunks = []
        for i, (off, n) in enumerate(_grid(shape, cuts)):
            if drop == (fqn, i):
                continue
            chunk = ChunkStorageMetadata(torch.Size(off), torch.Size(n))
            chunks.append(chunk)
            storage[MetadataIndex(fqn, chunk.offsets)] = _StorageInfo(
                f"__{i % 3}_0.distcp", offset, 7
            )
            offset += 7
        props = TensorProperties(dtype=torch.bfloat16)
        state[fqn] = TensorStorageMetadata(props, torch.Size(shape), chunks)
    state["lr"] = BytesStorageMetadata()
    storage[MetadataIndex("lr", None)] = _StorageInfo("__0_0.distcp", offset, 5)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def _write(tmp_path: Path, md: Metadata, name: str = "index") -> Path:
    data = encode_index(md, 1234, "0123456789abcdef")
    assert data is not None
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _overlap(a: tuple, b: tuple) -> bool:
    (o1, n1), (o2, n2) = a, b
    return all(x < y + m and y < x + k for x, k, y, m in zip(o1, n1, o2, n2))


def test_a_rank_finds_exactly_the_chunks_that_overlap_its_shards(tmp_path):
    md = _metadata()
    index = DcpIndex(_write(tmp_path, md))
    assert set(index.keys()) == set(md.state_dict_metadata)
    assert index.entries["columns"]["dim"] == 1 and index.entries["rows"]["dim"] == 0
    rng = random.Random(0)
    for fqn, (shape, _) in LAYOUTS.items():
        stored = md.state_dict_metadata[fqn].chunks
        for _ in range(60):
            lo = [rng.randrange(s) if s else 0 for s in shape]
            region = (lo, [rng.randint(1, s - o) if s else 0 for o, s in zip(lo, shape)])
            if not shape:
                region = ([], [])
            want = {
                (tuple(c.offsets), tuple(c.sizes))
                for c in stored
                if not shape or _overlap((c.offsets, c.sizes), region)
            }
            got = index.rows(fqn, [region])
            assert {(tuple(o), tuple(n)) for o, n, _ in got} == want, (fqn, region)
            for o, _, (f, offset, length) in got:  # each with its own storage
                info = md.storage_data[MetadataIndex(fqn, torch.Size(o))]
                assert (index.files[f], offset, length) == (info.relative_path, info.offset, 7)
    # DCP metadata of what a rank needs: the chunks of its region, the values it names.
    sub = index.metadata({"grid": [([16, 8], [16, 8])], "lr": None})
    assert set(sub.state_dict_metadata) == {"grid", "lr"}
    (chunk,) = sub.state_dict_metadata["grid"].chunks
    assert (list(chunk.offsets), list(chunk.sizes)) == ([16, 8], [16, 8])
    assert sub.storage_data[MetadataIndex("lr", None)].length == 5
    assert sub.state_dict_metadata["grid"].properties.dtype == torch.bfloat16
    full = index.metadata()
    for fqn, tmd in md.state_dict_metadata.items():
        got = full.state_dict_metadata[fqn]
        if isinstance(tmd, TensorStorageMetadata):
            assert got.size == tmd.size
            key = lambda c: (tuple(c.offsets), tuple(c.sizes))  # noqa: E731
            assert sorted(map(key, got.chunks)) == sorted(map(key, tmd.chunks))


def test_a_region_the_chunks_leave_a_gap_in_is_an_error(tmp_path):
    """A load must never leave part of a tensor as it was: the chunks found must cover the
    region a rank loads."""
    index = DcpIndex(_write(tmp_path, _metadata(drop=("rows", 3))))  # rows 24..31 missing
    index.metadata({"rows": [([0, 0], [16, 16])]})  # a region away from the gap loads
    with pytest.raises(UnsafeCheckpoint) as e:
        index.metadata({"rows": [([20, 0], [8, 16])]})
    assert "chunks cover 64 of 128 elements" in str(e.value) and str(tmp_path) in str(e.value)


def _patched(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at : at + len(data)] = data
    path.write_bytes(bytes(raw))


def test_the_index_records_each_keys_place_in_the_state_dict(tmp_path):
    """DCP's ``planner_data`` (a key's path in the nested state dict), which a restart's first
    save takes with the checkpoint's plans; an index without it (written before it was
    recorded, or from metadata without it) says it has none."""
    md = _metadata()
    assert DcpIndex(_write(tmp_path, md, "plain")).planner_data() is None
    paths = {fqn: tuple(fqn.split(".")) for fqn in md.state_dict_metadata}
    paths["lr"] = ("optimizer", "param_groups", 0, "lr")
    md.planner_data = paths
    index = DcpIndex(_write(tmp_path, md))
    assert index.planner_data() == paths
    assert index.stored_entries() == len(md.storage_data)


def test_a_damaged_or_hostile_index_is_an_error_naming_it(tmp_path):
    good = _write(tmp_path, _metadata()).read_bytes()
    header_len = int.from_bytes(good[8:16], "little")
    header = json.loads(good[16 : 16 + header_len])
    tables = len(good) - header["tables_bytes"]

    def fails(data: bytes, why: str, rows: bool = False) -> None:
        path = tmp_path / "bad"
        path.write_bytes(data)
        with pytest.raises(UnsafeCheckpoint) as e:
            index = DcpIndex(path)
            if rows:
                index.metadata()
        assert str(path) in str(e.value) and why in str(e.value), str(e.value)

    def with_header(**change) -> bytes:
        h = {**header, **change}
        body = json.dumps(h).encode()
        pad = b"\0" * (-(16 + len(body)) % 8)
        return good[:8] + len(body).to_bytes(8, "little") + body + pad + good[tables:]

    fails(b"", "magic")
    fails(b"NOTANIDX" + good[8:], "magic")
    fails(good[:8] + (1 << 40).to_bytes(8, "little") + good[16:], "header claims")
    fails(good[:16] + b"\xff" + good[17:], "not JSON")
    fails(good[: len(good) // 2], "tables claim")
    fails(with_header(tables_bytes=1 << 40), "tables claim")
    fails(with_header(files=["../escape.distcp"]), "escape")
    fails(with_header(version=2), "version")
    keys = [dict(e) for e in header["keys"]]
    keys[0]["n"] = 1 << 40
    fails(with_header(keys=keys), "lies outside the file")
    keys = [dict(e) for e in header["keys"]]
    keys[0]["dtype"] = "nn.Module"
    fails(with_header(keys=keys), "dtype")
    keys = [dict(e) for e in header["keys"]]
    del keys[1]["size"]
    fails(with_header(keys=keys), "lacks or mistypes")
    keys = [dict(e) for e in header["keys"]]
    keys[0]["p"] = {"__reduce__": "os.system"}  # a state-dict path is a list of keys
    fails(with_header(keys=keys), "has the path")
    # A row naming a file the index has not, or lying outside its tensor.
    rows_at = tables + header["keys"][0]["at"] + 8 * header["keys"][0]["n"]
    bad = bytearray(good)
    bad[rows_at + 8 * 4 : rows_at + 8 * 5] = (99).to_bytes(8, "little")  # file of row 0
    fails(bytes(bad), "lies outside its tensor or files", rows=True)
    bad = bytearray(good)
    bad[rows_at + 8 * 2 : rows_at + 8 * 3] = (1 << 20).to_bytes(8, "little")  # its rows
    fails(bytes(bad), "lies outside its tensor or files", rows=True)


def _saved(tmp_path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer, Path]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    with CheckpointManager(CheckpointConfig(enable=True, interval=1), tmp_path, model, opt) as m:
        m.save(1)
    return model, opt, tmp_path / "checkpoint" / "step-1"


def _replace_index(step: Path, data: bytes) -> None:
    """Write ``data`` as the index, and a manifest that agrees with it (as one who meant it)."""
    import xxhash

    (step / ".metadata.index").write_bytes(data)
    manifest = json.loads((step / "dcpkit.json").read_text())
    entry = {"size": len(data), CHECKSUM_ALGORITHM: xxhash.xxh3_64_hexdigest(data)}
    manifest["files"][".metadata.index"] = entry
    manifest.pop(SEAL)
    (step / "dcpkit.json").write_bytes(sealed_bytes(manifest))


def _load(tmp_path: Path, model, opt, verify: bool) -> int | None:
    cfg = CheckpointConfig(enable=True, interval=1, verify_on_load=verify)
    with CheckpointManager(cfg, tmp_path, model, opt) as m:
        return m.load()


def test_an_index_of_another_metadata_is_refused(tmp_path):
    model, opt, step = _saved(tmp_path)
    from dcpkit.formats.dcp import DCPCheckpoint

    with DCPCheckpoint(step) as ckpt:
        md = ckpt.metadata
    _replace_index(step, encode_index(md, (step / ".metadata").stat().st_size, "0" * 16))
    for verify in (False, True):
        with pytest.raises(CheckpointError) as e:
            _load(tmp_path, model, opt, verify)
        assert ".metadata.index" in str(e.value) and "was made from" in str(e.value)
    out = cli("verify", str(step))
    assert out.returncode == 1 and ".metadata.index" in out.stdout and "was made from" in out.stdout


def test_verify_compares_the_index_with_metadata_entry_by_entry(tmp_path):
    _, _, step = _saved(tmp_path)
    from dcpkit.formats.dcp import DCPCheckpoint

    manifest = json.loads((step / "dcpkit.json").read_text())
    bound = manifest["files"][".metadata"]
    assert cli("verify", str(step)).returncode == 0
    with DCPCheckpoint(step) as ckpt:
        md = ckpt.metadata
    key = next(k for k in md.storage_data if k.fqn == "0.weight")
    info = md.storage_data[key]
    md.storage_data[key] = _StorageInfo(info.relative_path, info.offset + 8, info.length)
    _replace_index(step, encode_index(md, bound["size"], bound[CHECKSUM_ALGORITHM]))
    out = cli("verify", str(step))
    assert out.returncode == 1
    assert "0.weight: 1 chunks (or their storage) differ from its own, unlike .metadata" in (
        out.stdout
    )


def test_a_corrupt_index_fails_a_verified_load_by_its_checksum(tmp_path):
    model, opt, step = _saved(tmp_path)
    path = step / ".metadata.index"
    _patched(path, path.stat().st_size - 3, b"\x7f")
    with pytest.raises(CheckpointError) as e:
        _load(tmp_path, model, opt, verify=True)
    assert ".metadata.index: checksum mismatch" in str(e.value)


def test_a_destination_of_another_shape_fails_as_it_does_without_the_index(tmp_path):
    """The index changes what a load reads, never its verdict: a parameter of another shape is
    DCP's own error, the same with the index and without it."""
    _, _, step = _saved(tmp_path)
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 5))
    opt = torch.optim.AdamW(other.parameters())
    errors = []
    for indexed in (True, False):
        if not indexed:
            (step / ".metadata.index").unlink()
            manifest = json.loads((step / "dcpkit.json").read_text())
            del manifest["files"][".metadata.index"]
            manifest.pop(SEAL)
            (step / "dcpkit.json").write_bytes(sealed_bytes(manifest))
        with pytest.raises(CheckpointError) as e:
            _load(tmp_path, other, opt, verify=False)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "Size mismatch" in errors[0], errors
