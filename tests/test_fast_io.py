"""The direct DCP reader: stored chunks read straight into their destinations, the same values as
DCP's own reader at any layout, and checksums verified in the same pass."""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader

from dcpkit import dist, safe_pickle
from dcpkit.engine.load import checksum_share
from dcpkit.formats import dcp_reader, torchfile
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


@pytest.mark.parametrize("block", [1 << 20, 4096 + 8])
def test_checksums_verified_in_the_same_pass(tmp_path, monkeypatch, block):
    # The tensors' bytes are hashed a block at a time as they land (one block, and many).
    monkeypatch.setattr(torchfile, "HASH_BLOCK", block)
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
    # Only part of the file needed: the rest is read to be hashed (in blocks), and still verifies.
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


def test_a_load_parses_metadata_at_most_once_and_not_at_all_with_its_index(tmp_path, monkeypatch):
    """A load reads the entries it needs from the index of ``.metadata`` that dcpkit writes at
    every save (a verified one checks the structure from it too): no parse of ``.metadata``.
    Without the index, a verified load checks the structure of ``.metadata`` before it reads,
    and then reads by that parse: one parse per load, verified or not (a 98 MiB one takes 4 s).
    The index is opened once per load too: a verified load reads by the one its checks read.
    The state loads back the same every way."""
    from dcpkit import CheckpointConfig, CheckpointManager
    from dcpkit.formats import dcp as dcp_format
    from dcpkit.formats import dcp_index
    from dcpkit.manifest import SEAL, sealed_bytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with CheckpointManager(CheckpointConfig(enable=True, interval=1), tmp_path, model, opt) as m:
        m.save(1)
    parses = []

    def counted(f, where):  # type: ignore[no-untyped-def]
        parses.append(where)
        return load_metadata(f, where)

    monkeypatch.setattr(safe_pickle, "load_metadata", counted)
    monkeypatch.setattr(dcp_format, "load_metadata", counted)
    opened = []
    open_index = dcp_index.DcpIndex.__init__

    def counted_index(self, path):  # type: ignore[no-untyped-def]
        opened.append(path)
        open_index(self, path)

    monkeypatch.setattr(dcp_index.DcpIndex, "__init__", counted_index)
    step = tmp_path / "checkpoint" / "step-1"
    assert (step / ".metadata.index").is_file()
    for indexed in (True, False):
        if not indexed:  # as an older dcpkit wrote it
            (step / ".metadata.index").unlink()
            manifest = json.loads((step / "dcpkit.json").read_text())
            del manifest["files"][".metadata.index"]
            manifest.pop(SEAL)
            (step / "dcpkit.json").write_bytes(sealed_bytes(manifest))
        for verify in (False, True):
            parses.clear()
            opened.clear()
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
            cfg = CheckpointConfig(enable=True, interval=1, verify_on_load=verify)
            with CheckpointManager(cfg, tmp_path, model, opt) as m:
                assert m.load() == 1
            assert len(parses) == (0 if indexed else 1), (indexed, verify, parses)
            assert len(opened) == (1 if indexed else 0), (indexed, verify, opened)
            assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


def test_a_damaged_archive_is_reported_with_its_tensor_and_the_rest_loads(tmp_path):
    """Archives are parsed before the hashed reads begin; one that does not parse is reported
    with its tensor's name (and the file's checksum), never raised, and the others load."""
    g = torch.Generator().manual_seed(2)
    state = {f"w{i}": torch.randn(128, 32, generator=g) for i in range(3)}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    expected = _checksums(tmp_path)
    with open(tmp_path / ".metadata", "rb") as f:
        meta = load_metadata(f, str(tmp_path))
    (info,) = [v for k, v in meta.storage_data.items() if k.fqn == "w1"]
    data = tmp_path / info.relative_path
    raw = bytearray(data.read_bytes())
    assert raw[info.offset : info.offset + 4] == b"PK\x03\x04"
    raw[info.offset : info.offset + 4] = b"XXXX"  # its first local header
    data.write_bytes(bytes(raw))
    reader = DirectFileSystemReader(tmp_path, checksums=expected)
    template = {k: torch.zeros(128, 32) for k in state}
    _load(tmp_path, reader, template)
    found = [str(p) for p in reader.problems]
    assert len(found) == 2 and found[0].startswith(f"{data.name}: w1: "), found
    assert (
        found[1] == f"{data.name}: checksum mismatch: the file's bytes changed after it was written"
    )
    assert torch.equal(template["w0"], state["w0"]) and torch.equal(template["w2"], state["w2"])
    assert not template["w1"].any()


class _ShortReads(io.FileIO):
    """A file whose reads return at most 64 bytes at a time, as a FUSE or network file system
    may return fewer bytes than asked."""

    def read(self, n=-1):
        return super().read(n if n is None or n < 0 else min(n, 64))

    def readinto(self, b):
        return super().readinto(memoryview(b).cast("B")[:64])


def test_verified_loads_read_through_short_reads(tmp_path, monkeypatch):
    """Every read of a load, verified or not, goes on until it is full: a file system returning
    short reads loads the same values, and verifies."""
    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(64, 48, generator=g) for i in range(3)}
    state["step"] = 7  # a byte record
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    expected = _checksums(tmp_path)
    opened = []

    def short_open(path, mode="rb", buffering=-1):
        opened.append(buffering)
        raw = _ShortReads(path, "rb")
        return raw if buffering == 0 else io.BufferedReader(raw)

    monkeypatch.setattr(dcp_reader, "open", short_open, raising=False)
    reader = DirectFileSystemReader(tmp_path, checksums=expected)
    template = {k: torch.zeros(64, 48) for k in state if k != "step"}
    template["step"] = 0
    _load(tmp_path, reader, template)
    assert 0 in opened and reader.problems == []
    assert template["step"] == 7
    assert all(torch.equal(template[k], state[k]) for k in state if k != "step")
    plain = {k: torch.zeros(64, 48) for k in state if k != "step"} | {"step": 0}
    _load(tmp_path, DirectFileSystemReader(tmp_path), plain)  # without checksums
    assert plain["step"] == 7 and all(torch.equal(plain[k], state[k]) for k in plain if k != "step")


def test_repeated_values_are_parsed_once_and_mutable_ones_never_shared(tmp_path, monkeypatch):
    """An optimizer's hyperparameters, stored once per parameter, parse once per distinct value;
    a list or dict value is parsed for each key (each gets its own object)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"optim": get_optimizer_state_dict(model, opt), "a": [1, 2], "b": [1, 2]}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    calls = []
    real = safe_pickle.load_value
    monkeypatch.setattr(safe_pickle, "load_value", lambda d, w: calls.append(w) or real(d, w))
    template = {"optim": get_optimizer_state_dict(model, opt), "a": None, "b": None}
    _load(tmp_path, DirectFileSystemReader(tmp_path), template)
    groups = [k for k in template["optim"]["param_groups"][0] if k != "params"]
    stored = 12 * len(groups) + 2  # per parameter, each hyperparameter; and the two lists
    assert len(calls) < stored / 4, (len(calls), stored)
    loaded = template["optim"]["param_groups"][0]
    assert {k: loaded[k] for k in groups} == {k: opt.param_groups[0][k] for k in groups}
    assert template["a"] == template["b"] == [1, 2] and template["a"] is not template["b"]
    assert sum("value a" in c or "value b" in c for c in calls) == 2


def test_each_rank_verifies_the_files_it_wrote(tmp_path, monkeypatch):
    """At a resume on the same layout, rank R checksums rank R's files (the ones it reads, so
    hashed in the same pass); at another world size the files are dealt in turn."""
    files = ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", ".metadata"]

    class Store:
        def read_manifest(self, name):
            return {"files": {f: {"xxh3_64": f"h{i}"} for i, f in enumerate(files)}}, None

    shares = {}
    for world in (2, 3):
        monkeypatch.setattr(dist, "world_size", lambda w=world: w)
        for rank in range(world):
            monkeypatch.setattr(dist, "rank", lambda r=rank: r)
            shares[world, rank] = sorted(checksum_share(Store(), "step-1"))
    assert shares[2, 0] == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert shares[2, 1] == ["__1_0.distcp", "__1_1.distcp"]
    for world in (2, 3):  # every file verified once
        dealt = sorted(f for r in range(world) for f in shares[world, r])
        assert dealt == sorted(files)
    assert [len(shares[3, r]) for r in range(3)] == [2, 2, 1]


def test_a_torch_file_without_crc32_verifies_and_a_damaged_one_does_not(tmp_path):
    """``dcpkit verify`` of a ``torch.save`` file checks each record's CRC-32 where it has one;
    a file saved without (``set_crc32_options(False)``) is readable, its records counted as
    unchecked."""
    from dcpkit.formats.structure import torch_file_problems

    value = {"w": torch.arange(4096, dtype=torch.float32)}
    plain, bare = tmp_path / "plain.pt", tmp_path / "bare.pt"
    torch.save(value, plain)
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(value, bare)
    finally:
        torch.serialization.set_crc32_options(True)
    assert torch_file_problems(plain)[0] == [] and torch_file_problems(bare)[0] == []
    assert torch_file_problems(bare)[1:] == (0, 7)  # nothing could be checked: and it says so
    with open(bare, "rb") as f:
        archive = torchfile.TorchSaveFile(f)
        assert torch.equal(archive.read(archive.obj["w"]), value["w"])
    raw = bytearray(plain.read_bytes())
    at = raw.index(value["w"].numpy().tobytes()[4000:4016])
    raw[at] ^= 0xFF
    plain.write_bytes(bytes(raw))
    assert [str(p) for p in torch_file_problems(plain)[0]] == [
        "plain.pt: record plain/data/0 fails its CRC-32 check"
    ]


def test_archives_are_opened_from_their_first_and_last_bytes(tmp_path):
    """Archives are opened from a read of their first and last few KiB; every record of a DCP
    checkpoint's files and of ``torch.save`` files with and without CRC-32 is where zipfile
    puts it. Sizes past the end of the file, and layouts torch.save does not write, go
    through zipfile: the same values, or the same error."""
    import io
    import zipfile

    from dcpkit.formats.torchfile import _scan_records, _zip_records

    state = {f"t{i}": torch.randn(8 * (i + 1), 5) for i in range(6)}
    dcp.save(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    with open(tmp_path / "ckpt" / ".metadata", "rb") as f:
        meta = load_metadata(f, str(tmp_path / "ckpt"))
    windows = 0
    for info in meta.storage_data.values():
        with open(tmp_path / "ckpt" / info.relative_path, "rb") as f:
            records, _ = _scan_records(f, info.offset, info.length)
            assert records == _zip_records(f, info.offset, info.length)
            windows += 1
    assert windows == len(state)
    for crc in (True, False):
        path = tmp_path / f"m{crc}.pt"
        torch.serialization.set_crc32_options(crc)
        try:
            torch.save({"sd": state, "step": 3}, path)
        finally:
            torch.serialization.set_crc32_options(True)
        size = path.stat().st_size
        with open(path, "rb") as f:
            records, head = _scan_records(f, 0, size)
            assert records == _zip_records(f, 0, size) and len(records) >= len(state) + 3
            assert head == path.read_bytes()[: len(head)]
            archive = torchfile.TorchSaveFile(f)
            assert archive.obj["step"] == 3
            assert torch.equal(archive.read(archive.obj["sd"]["t5"]), state["t5"])

    # Python's zipfile writing to a stream (data descriptors, its own extra fields): the same.
    buf = io.BytesIO()
    path = tmp_path / "mTrue.pt"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(_Unseekable(buf), "w") as dst:
        for name in src.namelist():
            dst.writestr(src.getinfo(name), src.read(name))
    streamed = buf.getvalue()
    records, _ = _scan_records(io.BytesIO(streamed), 0, len(streamed))
    assert records == _zip_records(io.BytesIO(streamed), 0, len(streamed))
    archive = torchfile.TorchSaveFile(io.BytesIO(streamed))
    assert torch.equal(archive.read(archive.obj["sd"]["t2"]), state["t2"])

    # A directory entry claiming more bytes than the file holds is never trusted; an archive
    # comment (not what torch.save writes) goes through zipfile.
    raw = bytearray(path.read_bytes())
    entry = raw.index(b"mTrue/data/0", raw.index(b"PK\x01\x02")) - 46
    raw[entry + 20 : entry + 28] = (1 << 30).to_bytes(4, "little") * 2
    assert _scan_records(io.BytesIO(bytes(raw)), 0, len(raw)) is None
    with pytest.raises(ValueError, match="truncated"):
        torchfile.TorchSaveFile(io.BytesIO(bytes(raw)))
    with zipfile.ZipFile(path, "a") as z:
        z.comment = b"hello"
    size = path.stat().st_size
    with open(path, "rb") as f:
        assert _scan_records(f, 0, size) is None
        archive = torchfile.TorchSaveFile(f)
        assert torch.equal(archive.read(archive.obj["sd"]["t0"]), state["t0"])


class _Unseekable:
    """A write-only stream without seek: Python's zipfile then writes data descriptors."""

    def __init__(self, buf) -> None:
        self.buf = buf

    def write(self, data) -> int:
        return self.buf.write(data)

    def flush(self) -> None:
        pass
