"""Store conformance: the same cases over every store (a local folder, ``memory://``, and S3 on
a real S3-compatible server on loopback), through the public API. A new store passes this file
before anything else uses it."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import uuid
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import BUCKET, ROOT, torchrun_env, use_endpoint
from dcpkit import CheckpointConfig, CheckpointManager, HFModel
from dcpkit.convert.torch_save import from_torch, to_torch
from dcpkit.integrity import verify_checkpoint
from dcpkit.layout import MANIFEST
from dcpkit.manifest import build_manifest
from dcpkit.models import build_model, flavors
from dcpkit.storage import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STORES = ["local", "memory", "moto", "seaweedfs"]


@pytest.fixture(params=STORES)
def root(request, tmp_path, monkeypatch):
    """A fresh checkpoint folder on each kind of store: S3 on moto (a mock server) and on
    SeaweedFS (a real object store), both on loopback."""
    if request.param == "local":
        yield str(tmp_path / "checkpoint")
    elif request.param == "memory":
        yield f"memory://dcpkit-{uuid.uuid4().hex}/checkpoint"
    else:
        import s3fs

        use_endpoint(monkeypatch, request.getfixturevalue(request.param))
        yield f"s3://{BUCKET}/conformance-{uuid.uuid4().hex}/checkpoint"
        s3fs.S3FileSystem.clear_instance_cache()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("llama3", "debugmodel", max_seq_len=16, n_layers=1)


def _manager(root: str, model, tmp_path, **cfg) -> CheckpointManager:
    config = CheckpointConfig(enable=True, folder=root, interval=1, **cfg)
    return CheckpointManager(config, tmp_path, model)


def _save_steps(root, tmp_path, steps, **cfg) -> torch.nn.Module:
    model = _model()
    with _manager(root, model, tmp_path, **cfg) as mgr:
        for step in steps:
            with torch.no_grad():
                model.norm.weight.fill_(float(step))
            mgr.save(step)
    return model


def test_publish_discovery_and_round_trip(root, tmp_path):
    model = _save_steps(root, tmp_path, [1, 2, 3], keep_latest_k=0)
    store = open_store(root)
    assert store.published_steps() == [1, 2, 3] and store.latest_step() == 3
    assert store.incomplete_names() == []
    manifest, problems = store.read_manifest("step-3")
    assert problems == [] and manifest["step"] == 3 and MANIFEST not in manifest["files"]
    fresh = _model(seed=1)
    assert _manager(root, fresh, tmp_path).load() == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    rows = {e.name: e for e in store.entries()}
    assert rows["step-3"].published and rows["step-3"].status == "published, 1 rank(s)"
    files = sum(f["size"] for f in manifest["files"].values())
    assert rows["step-3"].size == files + len(store.read_bytes(f"step-3/{MANIFEST}"))


def test_retention_deletes_only_after_publish(root, tmp_path):
    _save_steps(root, tmp_path, [1, 2, 3, 4], keep_latest_k=2)
    store = open_store(root)
    assert store.published_steps() == [3, 4]
    assert [n for n in store.list_names() if "step" in n] == ["step-3", "step-4"]


def _crash_before_commit(store, step: int, model) -> None:
    """What a writer killed between its last byte and the publish leaves: every file written
    (data, ``.metadata``, manifest), nothing published."""
    pending = store.begin(f"step-{step}", step)
    pending.prepare()
    dcp.save(dict(model.state_dict()), storage_writer=pending.dcp_writer(), no_dist=True)
    files = pending.describe([*pending.own_files(0), ".metadata"])
    pending.write_manifest(build_manifest(step, 1, ["model"], files))


def test_crash_before_commit_is_never_loaded_and_is_cleaned(root, tmp_path):
    model = _save_steps(root, tmp_path, [1])
    store = open_store(root)
    _crash_before_commit(store, 2, model)
    assert store.published_steps() == [1]
    assert len(store.incomplete_names()) == 1
    assert [e.published for e in store.entries()] == [True, False]
    fresh = _model(seed=1)
    mgr = _manager(root, fresh, tmp_path)  # a new run removes what the crash left
    assert store.incomplete_names() == []
    assert mgr.load() == 1
    mgr.save(2)
    mgr.close()
    assert store.published_steps() == [1, 2]


@pytest.mark.parametrize("point", ["mid_write", "before_publish"])
def test_a_writer_killed_during_a_save_leaves_the_previous_step_latest(root, tmp_path, point):
    """A real SIGKILL of the saving process (mid-write, or with every byte written but before
    the publish): the step is never published nor loaded, and the next run removes it."""
    if root.startswith("memory://"):
        pytest.skip("a memory:// store lives in one process: nothing outlives a killed writer")
    script = ROOT / "tests" / "scripts" / "save_steps.py"
    proc = subprocess.run(
        [sys.executable, str(script), root, "2"], cwd=tmp_path, capture_output=True,
        text=True, timeout=300, env=torchrun_env({"DCPKIT_FAILPOINT": f"{point}:2"}),
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL and "saved 1" in proc.stdout, proc.stderr[-2000:]
    store = open_store(root)
    assert store.published_steps() == [1]
    model = torch.nn.Linear(256, 256)
    config = CheckpointConfig(enable=True, folder=root, interval=1)
    with CheckpointManager(config, tmp_path, model) as mgr:
        assert store.incomplete_names() == []  # the new run removed what the kill left
        assert mgr.load() == 1 and torch.equal(model.bias, torch.full((256,), 1.0))
        mgr.save(2)
    assert store.published_steps() == [1, 2]


def test_a_half_done_delete_never_looks_complete(root, tmp_path):
    _save_steps(root, tmp_path, [1, 2], keep_latest_k=0)
    store = open_store(root)
    store.delete("step-1")
    assert store.published_steps() == [2] and store.incomplete_names() == []
    assert not store.exists("step-1")
    store.delete("step-1")  # deleting twice (two deleters racing) is harmless


def test_verify_names_the_same_fault_the_same_way(root, tmp_path):
    _save_steps(root, tmp_path, [1])
    store = open_store(root)
    assert verify_checkpoint(store, "step-1").ok
    data = sorted(n for n in store.list_names("step-1") if n.endswith(".distcp"))[0]
    blob = bytearray(store.read_bytes(f"step-1/{data}"))
    blob[len(blob) // 2] ^= 0xFF
    store.write_bytes(f"step-1/{data}", bytes(blob))
    problems = [str(p) for p in verify_checkpoint(store, "step-1").problems]
    assert problems == [f"{data}: checksum mismatch: the file's bytes changed after it was written"]
    assert verify_checkpoint(store, "step-1", checksums=False).ok
    store.write_bytes(f"step-1/{data}", b"short")
    problems = [str(p) for p in verify_checkpoint(store, "step-1", checksums=False).problems]
    assert problems[0] == (
        f"{data}: has 5 bytes, the manifest says {len(blob)}: truncated or replaced"
    )


def test_a_load_reads_by_the_index_of_metadata_on_every_store(root, tmp_path, monkeypatch):
    """On every store, a load plain or verified plans from the index of ``.metadata`` (a remote
    one is downloaded alone, into a temporary folder removed after the load) and no rank
    parses ``.metadata``; the state comes back bitwise. An index of another checkpoint's
    ``.metadata`` is refused, naming the file, wherever it lies."""
    import tempfile

    from dcpkit import safe_pickle
    from dcpkit.errors import CheckpointError
    from dcpkit.formats import dcp as dcp_format
    from dcpkit.layout import METADATA_INDEX

    model = _save_steps(root, tmp_path, [1, 2])
    parses = []
    real = safe_pickle.load_metadata

    def counted(f, where):  # type: ignore[no-untyped-def]
        parses.append(where)
        return real(f, where)

    monkeypatch.setattr(safe_pickle, "load_metadata", counted)
    monkeypatch.setattr(dcp_format, "load_metadata", counted)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for verify in (False, True):
        fresh = _model(seed=1)
        with _manager(root, fresh, tmp_path, verify_on_load=verify) as mgr:
            assert mgr.load() == 2
        assert parses == [], (verify, parses)
        for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
            assert torch.equal(a, b), name
        assert list(scratch.iterdir()) == []
    store = open_store(root)
    other = store.read_bytes(f"step-1/{METADATA_INDEX}")
    assert other != store.read_bytes(f"step-2/{METADATA_INDEX}")
    store.write_bytes(f"step-2/{METADATA_INDEX}", other)
    for verify in (False, True):
        mgr = _manager(root, _model(seed=1), tmp_path, verify_on_load=verify)
        with mgr, pytest.raises(CheckpointError, match=r"\.metadata\.index is not a usable index"):
            mgr.load()
    assert list(scratch.iterdir()) == []


def test_a_view_holds_metadata_and_its_index_whole_whatever_their_size(root, tmp_path, monkeypatch):
    """A remote checkpoint's view (behind verify, inspect, the conversions) holds large files
    as sparse stand-ins of their size, but never ``.metadata`` or its index: at thousands of
    ranks they are hundreds of MiB and are what the tools read by."""
    from dcpkit.formats.dcp import DCPCheckpoint
    from dcpkit.layout import METADATA, METADATA_INDEX
    from dcpkit.storage import fsspec as fsspec_store

    monkeypatch.setattr(fsspec_store, "_SMALL_FILE", 0)  # every file counts as large
    model = _save_steps(root, tmp_path, [1])
    store = open_store(root)
    report = verify_checkpoint(store, "step-1")  # the index compared with .metadata, entry by entry
    assert report.ok, report.problems
    with store.view("step-1", data=False) as view:
        for name in (METADATA, METADATA_INDEX):
            assert (view.path / name).read_bytes() == store.read_bytes(f"step-1/{name}")
        with DCPCheckpoint(view.path) as ckpt:
            assert set(model.state_dict()) <= set(ckpt.metadata.state_dict_metadata)


def test_checks_by_shares_leave_a_remote_metadata_where_it_is(root, tmp_path, monkeypatch):
    """A verified load's checks by shares read the index of ``.metadata``: a remote view
    fetches the index whole and leaves ``.metadata`` a stand-in of its size (its checksum is
    streamed from the store by the rank whose share it is, so a damaged one is still found).
    ``dcpkit verify``, without shares, fetches it to compare it with the index."""
    from dcpkit.layout import METADATA

    _save_steps(root, tmp_path, [1])
    store = open_store(root)
    remote = store.local_dir("step-1") is None
    fetched: list[str] = []
    if remote:
        real = store.fs.get

        def spy(rpath, lpath, *args, **kwargs):  # type: ignore[no-untyped-def]
            fetched.append(str(rpath).rsplit("/", 1)[-1])
            return real(rpath, lpath, *args, **kwargs)

        monkeypatch.setattr(store.fs, "get", spy)
    manifests = []
    read_manifest = store.read_manifest
    monkeypatch.setattr(store, "read_manifest", lambda n: manifests.append(n) or read_manifest(n))
    report = verify_checkpoint(store, "step-1", checksum_files=[METADATA], share=(0, 1))
    assert manifests == ["step-1"]  # read once, also to choose the view
    assert report.ok and report.metadata is None  # checked by the index
    assert (report.index is not None) == (not remote)  # a remote one's went with its view
    assert METADATA not in fetched
    full = verify_checkpoint(store, "step-1")
    assert full.ok and full.metadata is not None
    assert (METADATA in fetched) == remote
    blob = bytearray(store.read_bytes(f"step-1/{METADATA}"))
    blob[-3] ^= 0xFF
    store.write_bytes(f"step-1/{METADATA}", bytes(blob))
    report = verify_checkpoint(store, "step-1", checksum_files=[METADATA], share=(0, 1))
    assert [str(p) for p in report.problems] == [
        f"{METADATA}: checksum mismatch: the file's bytes changed after it was written"
    ]


def test_conversion_outputs_publish_through_the_store(root, tmp_path):
    _save_steps(root, tmp_path, [1])
    store = open_store(root)
    to_torch(store.location("step-1"), store.location("model.pth"))
    assert store.exists("model.pth") and not any(".tmp" in n for n in store.list_names())
    from_torch(store.location("model.pth"), store.location("back"))
    assert verify_checkpoint(store, "back").ok
    with pytest.raises(FileExistsError, match="--force"):
        to_torch(store.location("step-1"), store.location("model.pth"))


def test_hf_last_save_publishes_like_any_step(root, tmp_path):
    model = _model()
    args = flavors("llama3")["debugmodel"]
    config = CheckpointConfig(
        enable=True, folder=root, interval=1, last_save_in_hf=True, keep_latest_k=0
    )
    hf = HFModel("llama3", replace(args, n_layers=1, max_seq_len=16))
    with CheckpointManager(config, tmp_path, model, hf_model=hf) as mgr:
        mgr.save(1)
        mgr.save(2, last_step=True)
    store = open_store(root)
    assert store.published_steps() == [1, 2]
    names = set(store.list_names("step-2"))
    assert {"config.json", MANIFEST} <= names and names & {
        "model.safetensors",
        "model.safetensors.index.json",
    }
    assert not any(n.endswith(".staging") or n.startswith(".tmp") for n in store.list_names())
    assert verify_checkpoint(store, "step-2").ok


def test_a_slow_delete_does_not_hold_up_a_save(tmp_path, monkeypatch):
    """Retention runs in the background: a synchronous save returns once its step is
    published, whatever the deletion of old steps costs, and deletes nothing before."""
    from dcpkit.storage.local import LocalStore

    release = threading.Event()
    real_delete = LocalStore.delete

    def slow_delete(self, name):
        release.wait(timeout=60)
        real_delete(self, name)

    monkeypatch.setattr(LocalStore, "delete", slow_delete)
    root = str(tmp_path / "checkpoint")
    model = _model()
    mgr = _manager(root, model, tmp_path, keep_latest_k=2)
    for step in (1, 2, 3):
        assert mgr.save(step)  # step 3's save returns with step 1's deletion still blocked
    assert open_store(root).published_steps() == [1, 2, 3]
    release.set()
    mgr.wait()
    assert open_store(root).published_steps() == [2, 3]
    mgr.close()


def test_object_store_clients_never_draw_from_the_training_random_stream(tmp_path):
    """botocore's and urllib3's retry jitter and aiohttp's connection-queue shuffle draw from
    generators of their own once a store is open: a retried or queued request leaves the
    training's Python random stream where it was."""
    import random

    import aiohttp.connector
    import botocore.retryhandler
    from botocore.retries.standard import ExponentialBackoff
    from urllib3.exceptions import ConnectTimeoutError
    from urllib3.util.retry import Retry

    open_store(f"memory://dcpkit-{uuid.uuid4().hex}/checkpoint")
    random.seed(1234)
    before = random.getstate()
    ExponentialBackoff().delay_amount(type("Context", (), {"attempt_number": 3})())
    botocore.retryhandler.delay_exponential(base="rand", growth_factor=2, attempts=3)
    retry = Retry(total=5, backoff_factor=0.1, backoff_jitter=1.0)
    for _ in range(3):
        retry = retry.increment(method="GET", url="/", error=ConnectTimeoutError())
    assert retry.get_backoff_time() > 0
    aiohttp.connector.random.shuffle(list(range(8)))
    assert random.getstate() == before


def test_opening_a_store_leaves_the_python_random_stream_where_it_was():
    """In a fresh process: a store opened after the training seeded Python's random (s3fs's
    imports then run, and one of them draws from it) leaves the stream where it was."""
    code = (
        "import random; random.seed(7)\n"
        "from dcpkit.storage import open_store\n"
        "open_store('s3://dcpkit-test/never-touched')\n"
        "print(repr(random.random()))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) == random.Random(7).random()
