"""A checkpoint is data, never code: hostile pickles are refused by every entry point (the
marker file their payload would create never appears), and hostile structure is refused with a
message, without reading or allocating more than the files hold."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import BUCKET, Counter, cli
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager
from dcpkit.manifest import sealed_bytes
from dcpkit.models import build_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model(seed: int = 0):
    torch.manual_seed(seed)
    return build_model("llama3", "debugmodel", max_seq_len=16, n_layers=1)


def _checkpoint(root: Path) -> Path:
    """A real one-process checkpoint: model, a user state and RNG, at step 1."""
    cfg = CheckpointConfig(enable=True, interval=1)
    with CheckpointManager(cfg, root, _model(), states={"train_state": Counter()}) as mgr:
        mgr.save(1)
    return root / "checkpoint" / "step-1"


def _refused(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    return proc.stdout + proc.stderr


def _load(folder: Path, **cfg) -> int | None:
    config = CheckpointConfig(enable=True, **cfg)
    return CheckpointManager(config, folder, _model(1), states={"train_state": Counter()}).load()


@pytest.fixture
def hostile_metadata(tmp_path) -> tuple[Path, Path]:
    """A checkpoint whose ``.metadata`` is a pickle that would run a command (no manifest: as
    a checkpoint written by plain DCP or TorchTitan has none)."""
    ckpt = _checkpoint(tmp_path / "run")
    marker = tmp_path / "PWNED"
    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    (ckpt / "dcpkit.json").unlink()
    return ckpt, marker


def test_hostile_metadata_is_refused_everywhere(hostile_metadata, tmp_path):
    ckpt, marker = hostile_metadata
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=r"asks to load posix\.system"):
            _load(ckpt.parent.parent, verify_on_load=verify)
    with pytest.raises(CheckpointError, match=r"posix\.system"):
        _load(tmp_path / "fresh", initial_load_path=str(ckpt), initial_load_model_only=False)
    assert "posix.system" in _refused(cli("inspect", str(ckpt)))
    assert "posix.system" in _refused(cli("verify", str(ckpt)), code=1)
    assert "posix.system" in _refused(cli("diff", str(ckpt), str(ckpt)))
    out = str(tmp_path / "out")
    assert "posix.system" in _refused(cli("to-hf", str(ckpt), out, "--flavor", "debugmodel"))
    assert "posix.system" in _refused(cli("to-torch", str(ckpt), out + ".pth"))
    assert not marker.exists()


def test_hostile_metadata_on_s3_is_refused(s3, hostile_metadata, tmp_path):
    ckpt, marker = hostile_metadata
    url = f"s3://{BUCKET}/hostile/step-1"
    s3.put(str(ckpt), f"{BUCKET}/hostile/step-1", recursive=True)
    with pytest.raises(CheckpointError, match=r"posix\.system"):
        _load(tmp_path / "fresh", initial_load_path=url, initial_load_model_only=False)
    assert "posix.system" in _refused(cli("inspect", url))
    assert not marker.exists()


def test_hostile_rng_blob_and_value_are_refused(tmp_path):
    """dcpkit 0.1's pickled RNG blob and DCP's torch.save'd values are read without code."""
    marker = tmp_path / "PWNED"
    model = _model()
    for name, extra in {
        "rng": {"rng": {"rank_0": pickle.dumps(Payload(marker))}},
        "value": {"train_state": {"step": Payload(marker)}},
    }.items():
        ckpt = tmp_path / name / "checkpoint" / "step-1"
        state = {**model.state_dict(), "train_state": {"step": 1}, **extra}
        dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
        with pytest.raises(CheckpointError, match=r"asks to load posix\.system"):
            _load(tmp_path / name)
    out = str(tmp_path / "value.pth")
    _refused(cli("to-torch", str(tmp_path / "value" / "checkpoint" / "step-1"), out))
    assert not marker.exists()


def test_hostile_torch_save_is_refused_unless_trusted(tmp_path):
    marker = tmp_path / "PWNED"
    pth = tmp_path / "model.pth"
    torch.save({"w": torch.ones(3), "extra": Payload(marker)}, pth)
    for args in (["inspect", str(pth)], ["diff", str(pth), str(pth)]):
        assert "posix.system" in _refused(cli(*args))
    assert "--trust-pickle" in _refused(cli("from-torch", str(pth), str(tmp_path / "ckpt")))
    assert not marker.exists()
    # The one flag that lifts it, for a file the user wrote: its code runs.
    cli("inspect", str(pth), "--trust-pickle")
    assert marker.exists()


def test_a_damaged_pickle_in_a_torch_save_record_is_a_value_error():
    """A record's pickle cut short or garbled fails inside ``pickle`` in many ways (EOFError,
    UnpicklingError, ...): every reader gets one ``ValueError`` it reports with its file."""
    import io

    from dcpkit.formats.torchpickle import RefUnpickler

    whole = pickle.dumps({"lr": 0.1, "betas": (0.9, 0.95)}, protocol=2)
    for damaged in (whole[: len(whole) // 2], whole[:1], b"\x80\x02X\xff\xff\xff\x7f", b"\xfe"):
        with pytest.raises(ValueError, match="pickle does not parse"):
            RefUnpickler(io.BytesIO(damaged), "archive/").load()
    assert RefUnpickler(io.BytesIO(whole), "archive/").load() == {"lr": 0.1, "betas": (0.9, 0.95)}


# --- hostile structure ---------------------------------------------------------------------------


def _rewrite_metadata(ckpt: Path, change) -> None:  # type: ignore[no-untyped-def]
    """Edit a (trusted, test-made) ``.metadata`` and drop the manifest, as an attacker would."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    change(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    (ckpt / "dcpkit.json").unlink(missing_ok=True)


def _first_tensor(md):  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return next(
        (k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)
    )


def test_metadata_naming_files_outside_the_folder(tmp_path):
    ckpt = _checkpoint(tmp_path)

    def escape(md):  # type: ignore[no-untyped-def]
        for info in md.storage_data.values():
            info.relative_path = "../../../../etc/passwd"

    _rewrite_metadata(ckpt, escape)
    text = _refused(cli("to-torch", str(ckpt), str(tmp_path / "o.pth")))
    assert "'../../../../etc/passwd', outside its own folder" in text
    with pytest.raises(CheckpointError, match="outside its own folder"):
        _load(tmp_path, verify_on_load=False)


def test_metadata_whose_chunks_overlap_or_leave_a_gap(tmp_path):
    """Chunks that overlap, or leave part of a tensor unstored, are problems `dcpkit verify`
    lists and a verified load refuses, naming the tensor."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    for case in ("overlap", "gap"):
        ckpt = _checkpoint(tmp_path / case)
        fqn = ""

        def change(md, case=case):  # type: ignore[no-untyped-def]
            nonlocal fqn
            fqn, tmd = _first_tensor(md)
            whole = tmd.chunks[0]
            if case == "overlap":  # a second chunk over the first
                tmd.chunks.append(ChunkStorageMetadata(whole.offsets, whole.sizes))
            else:  # the chunk stops a row short
                tmd.chunks[0] = ChunkStorageMetadata(
                    whole.offsets, torch.Size([whole.sizes[0] - 1, *whole.sizes[1:]])
                )

        _rewrite_metadata(ckpt, change)
        expected = "overlap" if case == "overlap" else "chunks cover"
        text = _refused(cli("verify", str(ckpt)), code=1)
        assert f"{fqn}: chunks" in text and expected in text, text
        with pytest.raises(CheckpointError, match=f"{fqn}: chunks (at .* overlap|cover)"):
            _load(tmp_path / case, verify_on_load=True)


@pytest.mark.alone
def test_chunk_checks_stay_linear_and_bounded():
    """Chunks are checked with a sweep line: 4x the row shards (2048 -> 8192), or 4x the rows of
    a grid of 8 columns, take about 4x the time, where comparing every pair took 16x (and 4.2 s
    per tensor at 4096 shards); timed as a ratio in one run (best of 3), so that a slow or busy
    machine does not decide it. A layout that would make any sweep quadratic (a band of column
    strips beside a band of row strips) stops at a bounded number of comparisons with a problem
    of its own."""
    import time

    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

    from dcpkit.formats.structure import chunk_problems

    def rows_of(k):
        return [Chunk(torch.Size([16 * i, 0]), torch.Size([16, 64])) for i in range(k)]

    def grid_of(k):
        return [
            Chunk(torch.Size([4 * i, 64 * j]), torch.Size([4, 64]))
            for i in range(k)
            for j in range(8)
        ]

    def best_time(size, chunks):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            assert chunk_problems("w", size, chunks) == []
            times.append(time.perf_counter() - t0)
        return min(times)

    for few, many in (
        (([16 * 2048, 64], rows_of(2048)), ([16 * 8192, 64], rows_of(8192))),
        (([4 * 256, 512], grid_of(256)), ([4 * 1024, 512], grid_of(1024))),
    ):
        ratio = best_time(*many) / best_time(*few)
        assert ratio < 8, f"4x the chunks took {ratio:.1f}x the time (linear: 4x, pairs: 16x)"
    rows = rows_of(8192)
    # A chunk one row early overlaps its neighbour (and leaves a row unstored: the element
    # count alone would not tell), found at that scale too.
    rows[5000] = Chunk(torch.Size([16 * 5000 - 1, 0]), torch.Size([16, 64]))
    assert chunk_problems("w", [16 * 8192, 64], rows) == [
        f"w: chunks at [{16 * 4999}, 0] and [{16 * 5000 - 1}, 0] overlap"
    ]
    assert chunk_problems("w", [8, 8], [Chunk(torch.Size([4, 0]), torch.Size([5, 8]))]) == [
        "w: chunk at [4, 0] of size [5, 8] lies outside the shape [8, 8]",
        "w: chunks cover 0 of 64 elements",
    ]
    n = 600
    strips = [Chunk(torch.Size([0, i]), torch.Size([10, 1])) for i in range(n)]
    strips += [Chunk(torch.Size([10 + j, 0]), torch.Size([1, n])) for j in range(n)]
    assert chunk_problems("w", [10 + n, n], strips) == [
        "w: its 1200 chunks are laid out too irregularly to check for overlaps (no grid of "
        "chunks is)"
    ]


def test_metadata_claiming_more_than_the_files_hold(tmp_path):
    ckpt = _checkpoint(tmp_path)
    out = str(tmp_path / "o.pth")

    def huge(md):  # type: ignore[no-untyped-def]
        _, tmd = _first_tensor(md)
        tmd.size = torch.Size([1 << 40, 1 << 20])
        tmd.chunks[0].sizes = torch.Size([1 << 40, 1 << 20])

    _rewrite_metadata(ckpt, huge)
    assert "its record holds" in _refused(cli("to-torch", str(ckpt), out))

    ckpt = _checkpoint(tmp_path / "neg")
    _rewrite_metadata(ckpt, lambda md: setattr(_first_tensor(md)[1], "size", torch.Size([-4])))
    assert "negative size" in _refused(cli("to-torch", str(ckpt), out))

    ckpt = _checkpoint(tmp_path / "long")

    def past_end(md):  # type: ignore[no-untyped-def]
        for info in md.storage_data.values():
            info.length = 1 << 40

    _rewrite_metadata(ckpt, past_end)
    assert "too short for" in _refused(cli("to-torch", str(ckpt), out))
    assert "too short for" in _refused(cli("verify", str(ckpt)), code=1)


def test_symlink_out_of_the_folder(tmp_path):
    ckpt = _checkpoint(tmp_path)
    data = sorted(ckpt.glob("*.distcp"))[0]
    outside = tmp_path / "elsewhere.bin"
    shutil.copy(data, outside)
    data.unlink()
    data.symlink_to(outside)
    text = _refused(cli("to-torch", str(ckpt), str(tmp_path / "o.pth")))
    assert "outside the checkpoint folder" in text


def _hf_folder(tmp_path: Path) -> Path:
    from dcpkit.convert.hf import to_hf

    ckpt = _checkpoint(tmp_path / "src")
    out = tmp_path / "hf"
    to_hf(ckpt, out, "llama3", _flavor())
    return out


def _flavor():  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from dcpkit.models import flavors

    return replace(flavors("llama3")["debugmodel"], n_layers=1, max_seq_len=16)


def _set_header(path: Path, header: object, length: int | None = None) -> None:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    raw = json.dumps(header).encode()
    raw += b" " * max(0, n - len(raw))
    path.write_bytes((length or len(raw)).to_bytes(8, "little") + raw + data[8 + n :])


def test_hostile_safetensors_headers(tmp_path):
    hf = _hf_folder(tmp_path)
    shard = sorted(hf.glob("*.safetensors"))[0]
    original = shard.read_bytes()
    n = int.from_bytes(original[:8], "little")
    header = json.loads(original[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")

    def refused(expected: str) -> None:
        text = _refused(cli("inspect", str(hf)))
        assert expected in text, text
        shard.write_bytes(original)

    shard.write_bytes((1 << 40).to_bytes(8, "little") + original[8:])
    refused("header length 1099511627776")
    _set_header(shard, [1, 2, 3])
    refused("not a JSON object")
    bad = json.loads(json.dumps(header))
    bad[name]["data_offsets"][1] += 1 << 30
    _set_header(shard, bad)
    refused("its shape")
    others = [k for k in header if k not in ("__metadata__", name)]
    bad = json.loads(json.dumps(header))
    bad[others[0]]["data_offsets"] = header[name]["data_offsets"]
    bad[others[0]]["shape"], bad[others[0]]["dtype"] = header[name]["shape"], header[name]["dtype"]
    _set_header(shard, bad)
    refused("overlap")
    (hf / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {name: "../../outside.safetensors"}})
    )
    refused("outside its own folder")


def test_config_describing_more_than_the_folder_holds(tmp_path):
    hf = _hf_folder(tmp_path)
    config = json.loads((hf / "config.json").read_text())
    for change, expected in (
        ({"num_hidden_layers": 10**9}, "describes 1000000000 layers"),
        ({"vocab_size": 10**9}, "parameters, but the folder"),
    ):
        (hf / "config.json").write_text(json.dumps({**config, **change}))
        text = _refused(cli("from-hf", str(hf), str(tmp_path / "back")))
        assert expected in text, text


def test_manifest_naming_files_outside_the_folder(tmp_path):
    ckpt = _checkpoint(tmp_path)
    manifest = json.loads((ckpt / "dcpkit.json").read_text())
    manifest.pop("manifest_xxh3_64")
    manifest["files"]["../../escape"] = {"size": 1, "xxh3_64": "0"}
    (ckpt / "dcpkit.json").write_bytes(sealed_bytes(manifest))
    text = _refused(cli("verify", str(ckpt)), code=1)
    assert "names '../../escape', outside the checkpoint folder" in text


def test_files_are_created_with_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        ckpt = _checkpoint(tmp_path)
    finally:
        os.umask(old)
    for path in [ckpt, *ckpt.iterdir()]:
        assert not path.stat().st_mode & 0o002, path


def test_plain_dcp_checkpoints_still_load_and_inspect(tmp_path):
    """What plain ``dcp.save`` writes (tensors and non-tensor values) reads as before."""
    model = _model()
    ckpt = tmp_path / "checkpoint" / "step-5"
    state = {**model.state_dict(), "train_state": {"step": 5, "note": "plain", "hist": [1.5, 2]}}
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    counter = Counter()
    cfg = CheckpointConfig(enable=True)
    fresh = _model(1)
    assert CheckpointManager(cfg, tmp_path, fresh, states={"train_state": counter}).load() == 5
    assert counter.step == 5
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    proc = cli("inspect", str(ckpt), "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["objects"] == [
        "train_state.step",
        "train_state.note",
        "train_state.hist",
    ]
    out = tmp_path / "plain.pth"
    assert cli("to-torch", str(ckpt), str(out)).returncode == 0
    loaded = torch.load(out, weights_only=True)
    assert loaded["train_state"] == {"step": 5, "note": "plain", "hist": [1.5, 2]}


def test_a_newer_manifest_format_is_named(tmp_path):
    ckpt = _checkpoint(tmp_path)
    manifest = json.loads((ckpt / "dcpkit.json").read_text())
    manifest.pop("manifest_xxh3_64")
    manifest["format"] = "dcpkit-checkpoint/99"
    (ckpt / "dcpkit.json").write_bytes(sealed_bytes(manifest))
    text = _refused(cli("verify", str(ckpt)), code=1)
    assert "has format 'dcpkit-checkpoint/99'" in text and "upgrade" in text
    with pytest.raises(CheckpointError, match="dcpkit-checkpoint/99"):
        _load(tmp_path, verify_on_load=False)


def test_credentials_never_appear_in_messages(monkeypatch):
    from dcpkit.storage.fsspec import FsspecStore, scrub

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ENV-SECRET-VALUE")
    options = {"key": "AKIA-KEY-VALUE", "secret": "OPTION-SECRET", "client_kwargs": {"x": 1}}
    text = scrub("denied for AKIA-KEY-VALUE / OPTION-SECRET / ENV-SECRET-VALUE", options)
    assert text == "denied for *** / *** / ***"
    # Every message a store builds from an error goes through it.
    store = FsspecStore("memory://bucket/run", options)
    message = store._explain(store.root, PermissionError("bad signature for OPTION-SECRET"))
    assert "OPTION-SECRET" not in message and message.endswith("bad signature for ***")


def test_metadata_is_parsed_without_garbage_collections():
    """A `.metadata` is millions of objects at scale, none in a cycle: it is parsed with the
    cyclic garbage collector paused, whoever parses it (98 MiB, Llama 3 8B over 1024 ranks:
    18 s with the collections, 4 s without), and the collector is back on afterwards."""
    import gc
    import io

    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from dcpkit.safe_pickle import load_metadata

    chunks = [ChunkStorageMetadata(torch.Size([2 * j, 0]), torch.Size([2, 8])) for j in range(4)]
    props = TensorProperties(dtype=torch.float32)
    md = Metadata(
        {f"w{i}": TensorStorageMetadata(props, torch.Size([8, 8]), chunks) for i in range(20000)}
    )
    data = pickle.dumps(md)
    collections = []

    def seen(phase, info):  # type: ignore[no-untyped-def]
        if phase == "start":
            collections.append(info["generation"])

    assert gc.isenabled()
    gc.collect()  # the allocation counts start from zero: no collection is due before the parse
    gc.callbacks.append(seen)
    try:
        parsed = load_metadata(io.BytesIO(data), "test .metadata")
    finally:
        gc.callbacks.remove(seen)
    # At most the one young collection that catches up as the collector comes back on (with it
    # on throughout, this parse ran 171 collections).
    assert len(collections) <= 1, collections
    assert gc.isenabled()
    assert len(parsed.state_dict_metadata) == 20000
    # And the structure checks that follow it (the storage entries left out here: each chunk
    # is a problem, and still no collection).
    from dcpkit.formats.structure import metadata_problems

    gc.collect()
    collections.clear()
    gc.callbacks.append(seen)
    try:
        problems = metadata_problems(parsed)
    finally:
        gc.callbacks.remove(seen)
    assert len(collections) <= 1, collections
    assert len(problems) == 80000 and "w0: chunk at [0, 0] has no storage" in str(problems[0])
