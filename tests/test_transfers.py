"""Transfers to and from a real S3 server (SeaweedFS on loopback): a save's files leave as
parallel multipart uploads while they are written, hashed on the way; a verified load streams
each byte once, by parallel ranged reads, within its stated memory bound; a corrupted object is
caught by the same pass; a failed upload leaves no parts behind."""

from __future__ import annotations

import uuid

import pytest
import torch
import xxhash

from conftest import BUCKET, use_endpoint
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager
from dcpkit.layout import METADATA
from dcpkit.storage import open_store
from dcpkit.storage.transfer import HEAD, READ_PART, READS_IN_FLIGHT, UPLOAD_PART, WINDOWS_AHEAD
from dcpkit.storage.upload import PartUpload

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def folder(seaweedfs, monkeypatch):
    import s3fs

    use_endpoint(monkeypatch, seaweedfs)
    yield f"s3://{BUCKET}/transfers-{uuid.uuid4().hex}/checkpoint"
    s3fs.S3FileSystem.clear_instance_cache()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(5)))  # 20 MiB


def _trained(folder: str, tmp_path, steps=(1,), **cfg):
    model = _model(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = CheckpointConfig(enable=True, folder=folder, interval=1, **cfg)
    with CheckpointManager(config, tmp_path, model, optimizer) as mgr:
        for step in steps:
            model(torch.randn(4, 1024)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            mgr.save(step)
    return model, optimizer


def _client(store):
    return store.transport.client()


def _data_files(store, name: str) -> dict[str, int]:
    return {n: store.size(f"{name}/{n}") for n in store.list_names(name) if n.endswith(".distcp")}


def test_a_save_uploads_in_parts_and_a_verified_load_reads_each_byte_once(folder, tmp_path):
    model, optimizer = _trained(folder, tmp_path)
    store = open_store(folder)
    files = _data_files(store, "step-1")
    assert sum(files.values()) > 3 * UPLOAD_PART  # the rank's file went up in several parts
    bucket, prefix = store.path.split("/", 1)
    assert not _client(store).list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")
    manifest, problems = store.read_manifest("step-1")
    assert not problems
    for name in [*files, METADATA]:  # the checksums taken while uploading are the objects'
        whole = store.read_bytes(f"step-1/{name}")
        assert manifest["files"][name]["xxh3_64"] == xxhash.xxh3_64_hexdigest(whole), name
        assert manifest["files"][name]["size"] == len(whole)

    fresh, fresh_opt = _model(1), None
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    config = CheckpointConfig(enable=True, folder=folder, interval=1)  # verify_on_load: default
    with CheckpointManager(config, tmp_path, fresh, fresh_opt) as mgr:
        assert mgr.load() == 1
        transport = mgr.store.transport
        read, peak = transport.bytes_read, transport.peak_reading
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(
        optimizer.state_dict()["state"].values(),
        fresh_opt.state_dict()["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(a[k], b[k]) for k in a)
    data = sum(files.values())
    # Every data byte was read (checksummed) once, by the load itself: no pass of its own. The
    # record headers (4 KiB at each end of each record) are the only bytes read twice.
    records = len(model.state_dict()) * 3 + 16
    assert data <= read <= data + records * 2 * HEAD + (1 << 20), (read, data)
    assert peak <= READS_IN_FLIGHT * READ_PART + WINDOWS_AHEAD * 2 * HEAD, peak


def test_a_corrupted_object_fails_the_verified_load_and_falls_back(folder, tmp_path):
    _trained(folder, tmp_path, steps=(1, 2))
    store = open_store(folder)
    name = sorted(_data_files(store, "step-2"))[0]
    data = bytearray(store.read_bytes(f"step-2/{name}"))
    data[len(data) // 2] ^= 0x40  # a flipped bit inside a tensor's bytes
    store.write_bytes(f"step-2/{name}", bytes(data))

    fresh = _model(1)
    config = CheckpointConfig(enable=True, folder=folder, interval=1)
    optimizer = torch.optim.AdamW(fresh.parameters())
    with (
        CheckpointManager(config, tmp_path, fresh, optimizer) as mgr,
        pytest.raises(CheckpointError) as failure,
    ):
        mgr.load()
    assert "checksum mismatch" in str(failure.value) and name in str(failure.value)

    config = CheckpointConfig(enable=True, folder=folder, interval=1, fallback_on_corruption=True)
    with CheckpointManager(config, tmp_path, fresh, torch.optim.AdamW(fresh.parameters())) as mgr:
        assert mgr.load() == 1


def test_an_upload_that_fails_leaves_no_parts_and_no_object(folder):
    store = open_store(folder)
    bucket, prefix = store.path.split("/", 1)
    path = f"{store.path}/partial.bin"
    upload = PartUpload(store.transport, path)
    upload.write(b"\1" * (3 * UPLOAD_PART + 5))  # three parts on the wire, one being filled
    upload.abort()
    assert not _client(store).list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads")
    assert not store.fs.exists(path)

    upload = PartUpload(store.transport, path)  # and a complete one is the bytes written
    payload = bytes(range(256)) * ((UPLOAD_PART + 777) // 256)
    for at in range(0, len(payload), 3 << 20):
        upload.write(payload[at : at + (3 << 20)])
    upload.close()
    assert store.read_bytes("partial.bin") == payload
