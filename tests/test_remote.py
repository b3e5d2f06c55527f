"""Checkpoints on S3: a real S3-compatible server (SeaweedFS) on loopback, s3fs, torchrun runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import BUCKET, cli, read_metrics, run_train, start_moto
from dcpkit.layout import COMMIT_MARKER


@pytest.mark.dist
def test_train_on_s3_and_resume_bitwise(s3, reference_run, tmp_path):
    url = f"s3://{BUCKET}/run/checkpoint"
    dump = tmp_path / "dump"
    run_train(2, dump, "--checkpoint.folder", url, "--training.stop_at_step", "10")
    assert sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{BUCKET}/run/checkpoint")) == [
        "step-10",
        "step-5",
    ]
    assert s3.exists(f"{BUCKET}/run/checkpoint/step-10/{COMMIT_MARKER}")
    proc = run_train(2, dump, "--checkpoint.folder", url, "--checkpoint.async_mode", "async")
    assert f"loaded {url}/step-10" in proc.stdout
    ref, got = read_metrics(reference_run), read_metrics(dump)
    for step in range(1, 21):
        assert got[step]["loss"] == ref[step]["loss"], f"step {step}"

    # The tools read s3:// paths.
    proc = cli("list", url)
    assert proc.returncode == 0 and "step-20" in proc.stdout and "published" in proc.stdout
    proc = cli("verify", f"{url}/step-20")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = cli("inspect", f"{url}/step-20", "--json")
    assert proc.returncode == 0 and '"world_size": 2' in proc.stdout
    proc = cli("to-hf", f"{url}/step-20", str(tmp_path / "hf"), "--flavor", "debugmodel")
    assert proc.returncode == 0, proc.stderr
    proc = cli("to-torch", f"{url}/step-20", str(tmp_path / "m.pth"), "--model-only")
    assert proc.returncode == 0, proc.stderr
    proc = cli("diff", f"{url}/step-20", str(tmp_path / "hf"))
    assert proc.returncode == 0 and "57 identical" in proc.stdout
    assert f"of {url}/step-20 are not compared" in proc.stdout, proc.stdout  # the URL it read
    assert "dcpkit-remote-" not in proc.stdout  # never its local stand-in
    # Read from S3 in place, the tensors are the bytes of the local run's step 20.
    proc = cli("diff", f"{url}/step-20", str(reference_run / "checkpoint" / "step-20"))
    assert proc.returncode == 0 and "identical" in proc.stdout, proc.stdout


def test_inspect_and_verify_read_no_tensor_data(s3, reference_run, tmp_path):
    """The metadata-only copy behind inspect and verify: data files stay sparse (records'
    headers are read by small ranged requests); verify streams the checksums from the remote
    files, so remote corruption is still found."""
    import torch

    from dcpkit.formats.dcp import DCPCheckpoint
    from dcpkit.storage import open_checkpoint

    local = reference_run / "checkpoint" / "step-20"
    url = f"s3://{BUCKET}/tools/checkpoint/step-20"
    s3.put(str(local), f"{BUCKET}/tools/checkpoint/step-20", recursive=True)
    s3.touch(f"{BUCKET}/tools/checkpoint/step-20/{COMMIT_MARKER}")
    data = sorted(f.name for f in local.iterdir() if f.suffix == ".distcp")
    with open_checkpoint(url, data=False) as view:
        copy = view.path
        for name in data:
            size = (local / name).stat().st_size
            assert (copy / name).stat().st_size == size
            assert (copy / name).stat().st_blocks * 512 < size // 4  # sparse: not downloaded
        assert (copy / ".metadata").read_bytes() == (local / ".metadata").read_bytes()
        with view.opener(copy / data[0]) as f:  # records' headers: small ranged reads
            assert f.read(4) == (local / data[0]).read_bytes()[:4]
        first = (local / data[0]).stat().st_size
        assert (copy / data[0]).stat().st_blocks * 512 < first // 4  # still not downloaded
    # Conversions and diff read the tensors from the remote files by range requests.
    with open_checkpoint(url) as view:
        with (
            DCPCheckpoint(view.path, view.opener) as remote_ckpt,
            DCPCheckpoint(local) as local_ckpt,
        ):
            assert sorted(remote_ckpt.tensors) == sorted(local_ckpt.tensors)
            for name in remote_ckpt.tensors:
                assert torch.equal(remote_ckpt.read(name), local_ckpt.read(name)), name
            name = "tok_embeddings.weight"
            assert torch.equal(remote_ckpt.read(name, (100, 300)), local_ckpt.read(name)[100:300])
        for name in data:
            assert (view.path / name).stat().st_blocks * 512 < (1 << 20)
    proc = cli("inspect", url, "--json")
    info = json.loads(proc.stdout)
    assert info["published"] and info["complete"] and info["world_size"] == 2
    assert cli("verify", url).returncode == 0

    # One flipped byte in a remote data file: the sizes still match, the checksum does not.
    blob = bytearray((local / data[1]).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    s3.pipe(f"{BUCKET}/tools/checkpoint/step-20/{data[1]}", bytes(blob))
    proc = cli("verify", url)
    assert proc.returncode == 1 and f"{data[1]}: checksum mismatch" in proc.stdout, proc.stdout
    assert cli("verify", url, "--quick").returncode == 0
    # Truncated: found from the listing alone; without the marker, a note says it is not picked.
    s3.pipe(f"{BUCKET}/tools/checkpoint/step-20/{data[0]}", b"short")
    s3.rm(f"{BUCKET}/tools/checkpoint/step-20/{COMMIT_MARKER}")
    proc = cli("verify", url, "--quick")
    assert proc.returncode == 1 and f"{data[0]}: has 5 bytes" in proc.stdout, proc.stdout
    assert "never committed" in proc.stdout
    assert not json.loads(cli("inspect", url, "--json").stdout)["published"]


@pytest.mark.dist
def test_writer_killed_mid_upload_is_never_picked(s3, reference_run, tmp_path):
    url = f"s3://{BUCKET}/killed/checkpoint"
    dump = tmp_path / "dump"
    proc = run_train(
        2,
        dump,
        "--checkpoint.folder",
        url,
        env={"DCPKIT_FAILPOINT": "before_publish:10:0"},
        check=False,
    )
    assert proc.returncode != 0
    # Data, metadata and manifest of step 10 were uploaded, the commit marker was not.
    assert s3.exists(f"{BUCKET}/killed/checkpoint/step-10/.metadata")
    assert not s3.exists(f"{BUCKET}/killed/checkpoint/step-10/{COMMIT_MARKER}")
    listing = cli("list", url).stdout
    assert "incomplete" in listing.split("step-10")[1].splitlines()[0]
    proc = run_train(2, dump, "--checkpoint.folder", url)
    assert f"loaded {url}/step-5" in proc.stdout
    ref, got = read_metrics(reference_run), read_metrics(dump)
    for step in range(6, 21):
        assert got[step]["loss"] == ref[step]["loss"], f"step {step}"


@pytest.mark.dist
def test_initial_load_from_s3_dcp_and_hf(s3, stopped_run, tmp_path):
    """initial_load_path on S3: a DCP step uploaded by hand (no commit marker) and a Hugging Face
    export, read in place; both start training exactly as the local step does."""
    from dcpkit.convert.hf import to_hf

    step10 = stopped_run / "checkpoint" / "step-10"
    to_hf(step10, tmp_path / "hf", "llama3", "debugmodel")
    s3.put(str(step10), f"{BUCKET}/seed/step-10", recursive=True)
    s3.put(str(tmp_path / "hf"), f"{BUCKET}/seed/hf", recursive=True)
    one = ("--training.steps", "1")
    runs = {
        "local": run_train(2, tmp_path / "a", *one, "--checkpoint.initial_load_path", str(step10)),
        "s3 dcp": run_train(
            2, tmp_path / "b", *one, "--checkpoint.initial_load_path", f"s3://{BUCKET}/seed/step-10"
        ),
        "s3 hf": run_train(
            2,
            tmp_path / "c",
            *one,
            "--checkpoint.initial_load_path",
            f"s3://{BUCKET}/seed/hf",
            "--checkpoint.initial_load_in_hf",
            "true",
        ),
    }
    assert f"loaded s3://{BUCKET}/seed/step-10 (initial_load_path" in runs["s3 dcp"].stdout
    assert f"loaded s3://{BUCKET}/seed/hf (initial_load_path" in runs["s3 hf"].stdout
    losses = {name: read_metrics(tmp_path / d)[1]["loss"] for name, d in zip(runs, "abc")}
    assert len(set(losses.values())) == 1, losses
    proc = run_train(
        2,
        tmp_path / "d",
        *one,
        "--checkpoint.initial_load_path",
        f"s3://{BUCKET}/seed/hf",
        check=False,
    )
    assert proc.returncode != 0 and f"s3://{BUCKET}/seed/hf' is a Hugging Face folder" in (
        proc.stderr
    )
    assert "set initial_load_in_hf = true" in proc.stderr


def test_missing_bucket_and_bad_url_name_the_url(s3, tmp_path):
    proc = cli("list", "s3://no-such-bucket/run")
    assert proc.returncode != 0 and "s3://no-such-bucket/run" in proc.stderr
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    for cmd in ("inspect", "verify", "to-hf"):
        missing = f"s3://{BUCKET}/nothing/step-5"
        out = [str(tmp_path / "out"), "--flavor", "debugmodel"] if cmd == "to-hf" else []
        proc = cli(cmd, missing, *out)
        assert proc.returncode == 2, (cmd, proc.stderr)
        assert f"{missing} does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_an_output_url_in_a_missing_bucket_names_the_url_and_bucket(s3, stopped_run, tmp_path):
    ckpt = str(stopped_run / "checkpoint" / "step-10")
    hf = tmp_path / "hf"
    assert cli("to-hf", ckpt, str(hf), "--flavor", "debugmodel").returncode == 0
    for cmd, src, out in (
        ("to-torch", ckpt, "s3://nosuchbkt/m.pth"),
        ("from-hf", str(hf), "s3://nosuchbkt/imp"),
        ("to-hf", ckpt, "s3://nosuchbkt/hf"),
    ):
        extra = ["--flavor", "debugmodel"] if cmd == "to-hf" else []
        proc = cli(cmd, src, out, *extra)
        assert proc.returncode == 2, (cmd, proc.stderr)
        assert f"{out}: the bucket 'nosuchbkt' does not exist" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr


def test_the_trainer_names_a_missing_bucket(s3, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcpkit.train",
            "--job.config_file",
            str(__import__("conftest").CONFIG),
            "--job.dump_folder",
            str(tmp_path),
            "--checkpoint.folder",
            "s3://no-such-bucket/run/checkpoint",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "s3://no-such-bucket/run/checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_wrong_credentials_name_the_url(tmp_path):
    # A server that checks every request's credentials: unknown keys are rejected.
    server, port = start_moto(tmp_path / "moto.log", {"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": "wrong",
            "AWS_SECRET_ACCESS_KEY": "wrong",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        proc = subprocess.run(
            [sys.executable, "-m", "dcpkit.cli", "list", "s3://any/run"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert proc.returncode != 0
    assert "s3://any/run: the credentials were rejected" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_retention_on_s3_removes_a_step_completely_and_list_never_calls_it_abandoned(s3):
    import torch

    from dcpkit import CheckpointConfig, CheckpointManager
    from dcpkit.layout import DELETING
    from dcpkit.storage import open_store

    url = f"s3://{BUCKET}/retention/checkpoint"
    cfg = CheckpointConfig(enable=True, folder=url, interval=1, keep_latest_k=2)
    with CheckpointManager(cfg, ".", torch.nn.Linear(4, 4)) as mgr:
        for step in range(1, 5):
            mgr.save(step)
        mgr.wait()
    s3.invalidate_cache()
    left = sorted(p.rsplit("/", 1)[-1] for p in s3.ls(f"{BUCKET}/retention/checkpoint"))
    assert [n for n in left if n.startswith("step-")] == ["step-3", "step-4"]
    assert s3.find(f"{BUCKET}/retention/checkpoint/step-1", withdirs=True) == []
    proc = cli("list", url)
    assert proc.returncode == 0 and "incomplete" not in proc.stdout and "step-2" not in proc.stdout
    # A deletion caught half-way (marked, uncommitted, its data still there): listed as such,
    # never loaded, and removed by the next run that saves into the folder.
    store = open_store(url)
    store.write_bytes(f"step-3/{DELETING}", b"")
    store.remove(f"step-3/{COMMIT_MARKER}")
    lines = [x for x in cli("list", url).stdout.splitlines() if x.startswith("step-3")]
    assert len(lines) == 1 and "being deleted by retention" in lines[0], lines
    with CheckpointManager(cfg, ".", torch.nn.Linear(4, 4)) as mgr:
        assert mgr.load() == 4
    assert "step-3" not in store.list_names()


def test_a_frozen_base_on_s3_is_uploaded_once_then_copied_by_the_store(s3, caplog):
    """A model whose first layer is frozen (a LoRA run's base), saved to S3 (SeaweedFS): the
    first save uploads the frozen file, the next ones have the store copy it into their step
    (no byte of it uploaded, said in the log), each step whole on its own (verified, loaded
    after the first is deleted); a frozen tensor changed in place is uploaded anew."""
    import logging

    import torch

    from dcpkit import CheckpointConfig, CheckpointManager
    from dcpkit.tools.verify import verify_path

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        m[0].requires_grad_(False)
        return m

    url = f"s3://{BUCKET}/frozen/checkpoint"
    cfg = CheckpointConfig(enable=True, folder=url, interval=1, keep_latest_k=0)
    trained = model()
    with (
        caplog.at_level(logging.INFO, logger="dcpkit"),
        CheckpointManager(cfg, ".", trained) as mgr,
    ):
        for step in (1, 2, 3):
            mgr.save(step)
        with torch.no_grad():
            trained[0].weight.add_(1)  # frozen, changed in place
        mgr.save(4)
    linked = [r.getMessage() for r in caplog.records if "not written again" in r.getMessage()]
    assert len(linked) == 2 and all("frozen/checkpoint/step-" in x for x in linked), linked
    s3.invalidate_cache()
    frozen = {
        s: s3.cat(f"{BUCKET}/frozen/checkpoint/step-{s}/__0_10000.distcp") for s in range(1, 5)
    }
    assert frozen[1] == frozen[2] == frozen[3] != frozen[4]
    s3.rm(f"{BUCKET}/frozen/checkpoint/step-1", recursive=True)
    for step in (2, 3, 4):
        assert verify_path(f"{url}/step-{step}").ok, step
    for step, changed in ((3, False), (4, True)):
        loaded = model()
        with CheckpointManager(CheckpointConfig(enable=True, folder=url, load_step=step), ".",
                               loaded) as mgr:  # fmt: skip
            mgr.load()
        assert torch.equal(loaded[0].weight, trained[0].weight) == changed
        assert torch.equal(loaded[0].weight + (0 if changed else 1), trained[0].weight)
