"""Integration: real torchrun runs of the reference trainer that save, stop, kill and resume."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from conftest import (
    CONFIG,
    ROOT,
    TEST_SEQ_LEN,
    copy_checkpoint,
    read_manifest,
    read_metrics,
    run_script,
    run_train,
    torchrun_env,
)
from dcpkit.formats.dcp import DCPCheckpoint
from dcpkit.models import build_model
from dcpkit.storage import open_store

pytestmark = pytest.mark.dist


def test_reference_run_writes_metrics_checkpoints_and_tokenizer(reference_run):
    metrics = read_metrics(reference_run)
    assert sorted(metrics) == list(range(1, 21))
    for step, rec in metrics.items():
        for key in ("step", "loss", "lr", "tokens_seen", "world_size", "checkpoint_stall_s"):
            assert key in rec
        assert rec["world_size"] == 2
        assert rec["tokens_seen"] == step * 8 * TEST_SEQ_LEN
        assert rec["checkpoint_stall_s"] >= 0
        assert rec["checkpoint_saved"] == (step % 5 == 0)
    # keep_latest_k = 3 in the config: the oldest (step 5) is gone.
    assert open_store(reference_run / "checkpoint").published_steps() == [10, 15, 20]
    assert open_store(reference_run / "checkpoint").incomplete_names() == []
    manifest = read_manifest(reference_run / "checkpoint" / "step-10")
    assert manifest["world_size"] == 2 and manifest["step"] == 10
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["files"])
    assert manifest["groups"] == [
        "model",
        "optimizer",
        "lr_scheduler",
        "dataloader",
        "train_state",
        "rng",
    ]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(reference_run / "tokenizer.json"))
    assert (
        tok.decode(tok.encode("def main():\n    return 0\n").ids) == "def main():\n    return 0\n"
    )
    # Training makes progress.
    assert metrics[20]["loss"] < metrics[1]["loss"] - 0.5


def test_stop_and_resume_at_same_world_size_is_bitwise(reference_run, stopped_run, tmp_path):
    dump = tmp_path / "resumed"
    shutil.copytree(stopped_run, dump)
    assert open_store(dump / "checkpoint").published_steps() == [5, 10]
    proc = run_train(2, dump)
    assert "loaded" in proc.stdout and "step-10" in proc.stdout
    ref, got = read_metrics(reference_run), read_metrics(dump)
    assert sorted(got) == list(range(1, 21))
    for step in range(1, 21):
        assert got[step]["loss"] == ref[step]["loss"], f"step {step}"
        assert got[step]["tokens_seen"] == ref[step]["tokens_seen"]
        assert got[step]["lr"] == ref[step]["lr"]


def _saved_full_state(ckpt_dir):
    """The checkpoint's model and optimizer tensors, read whole by one process."""
    model = build_model("llama3", "debugmodel", max_seq_len=128)
    optimizer = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 1.0
    )  # adds initial_lr, as in training
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    template = {
        **{k: v.detach().clone() for k, v in model.state_dict().items()},
        "optimizer": get_optimizer_state_dict(model, optimizer, options=opts),
    }
    dcp.load(template, checkpoint_id=str(ckpt_dir), no_dist=True)
    return template


@pytest.mark.parametrize("nproc", [1, 4])
def test_resume_at_other_world_size(reference_run, stopped_run, tmp_path, nproc):
    dump = tmp_path / f"n{nproc}"
    copy_checkpoint(stopped_run, 10, dump)
    ckpt = dump / "checkpoint" / "step-10"

    # 1. What each rank restores equals what was saved, exactly, read by the index of
    # .metadata (verified by shares of it, as verify_on_load does by default): no rank parses
    # the whole .metadata.
    out = tmp_path / "loaded.pt"
    run_script(
        nproc,
        "dump_loaded_state.py",
        str(out),
        "--job.config_file",
        str(CONFIG),
        "--job.dump_folder",
        str(dump),
        env={"FORBID_METADATA_PARSE": "1"},
    )
    loaded = torch.load(out, weights_only=False)
    saved = _saved_full_state(ckpt)
    assert loaded["step"] == 10
    for name, tensor in loaded["model"].items():
        assert torch.equal(tensor, saved[name]), name
    assert loaded["optimizer"].keys() == saved["optimizer"].keys()
    for key, value in loaded["optimizer"].items():
        if torch.is_tensor(value):
            assert torch.equal(value, saved["optimizer"][key]), key
        else:
            assert value == saved["optimizer"][key], key
    assert loaded["train_state"] == {"step": 10, "ntokens_seen": 10 * 8 * TEST_SEQ_LEN}
    assert loaded["dataloader"]["samples_consumed"] == 10 * 8
    assert loaded["lr_scheduler"]["last_epoch"] == 10

    # 2. Training continues on the same samples: same tokens, same losses to 1e-3.
    proc = run_train(nproc, dump)
    assert f"RNG saved by 2 ranks, restored on {nproc}" in proc.stdout
    # Each rank reads its own rows of the records it shares with another (at 4 ranks, every
    # record of the 2-rank checkpoint): nothing is read twice, so nothing is sent between ranks.
    read = r"stored \([\d.]+x\) on \d+ rank\(s\) \(each its own\)"
    assert re.search(read, proc.stdout + proc.stderr), proc.stdout[-3000:]
    ref, got = read_metrics(reference_run), read_metrics(dump)
    assert sorted(got) == list(range(11, 21))
    for step in range(11, 21):
        assert got[step]["world_size"] == nproc
        assert got[step]["tokens_seen"] == ref[step]["tokens_seen"]
        rel = abs(got[step]["loss"] - ref[step]["loss"]) / abs(ref[step]["loss"])
        assert rel < 1e-3, (step, got[step]["loss"], ref[step]["loss"])


@pytest.mark.parametrize(
    "failpoint",
    [
        "mid_write:10:1",  # rank 1's data is on disk, rank 0 has not written .metadata
        "before_publish:10:0",  # data, metadata and manifest written, not yet renamed
    ],
)
def test_sigkill_during_save_resumes_from_previous_step(reference_run, tmp_path, failpoint):
    dump = tmp_path / "killed"
    proc = run_train(2, dump, env={"DCPKIT_FAILPOINT": failpoint}, check=False)
    assert proc.returncode != 0
    folder = dump / "checkpoint"
    assert open_store(folder).published_steps() == [5]
    # What the crash left, unless the surviving rank removed it before torchrun stopped it too.
    assert open_store(folder).incomplete_names() in ([".tmp-step-10"], [])
    assert open_store(folder).latest_step() == 5

    proc = run_train(2, dump, "--training.stop_at_step", "12")  # the schedule of 20
    assert "step-5" in proc.stdout
    assert open_store(folder).incomplete_names() == []
    ref, got = read_metrics(reference_run), read_metrics(dump)
    for step in range(6, 13):
        assert got[step]["loss"] == ref[step]["loss"], f"step {step}"


def test_tensor_parallel_checkpoint_reshards_to_fsdp(reference_run, tmp_path):
    dump = tmp_path / "tp"
    run_train(2, dump, "--parallelism.tensor_parallel_degree", "2", "--training.stop_at_step", "3")
    run_train(2, dump, "--training.stop_at_step", "5")
    ref, got = read_metrics(reference_run), read_metrics(dump)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step in range(1, 6):
        assert abs(got[step]["loss"] - ref[step]["loss"]) / ref[step]["loss"] < 1e-3


def test_qwen3_tied_embeddings_stay_tied_under_tp_and_reshard(tmp_path):
    qwen = ("--model.name", "qwen3", "--training.steps", "4", "--training.seq_len", "64")
    qwen += ("--training.global_batch_size", "4")  # a smaller step: qwen3's debugmodel is wide
    ref = tmp_path / "fsdp"
    run_train(2, ref, *qwen)
    dump = tmp_path / "tp"
    run_train(
        2, dump, *qwen, "--parallelism.tensor_parallel_degree", "2", "--training.stop_at_step", "2"
    )
    with DCPCheckpoint(dump / "checkpoint" / "step-2") as ckpt:
        # One weight: trained as one under tensor parallelism, saved as one.
        assert torch.equal(ckpt.read("output.weight"), ckpt.read("tok_embeddings.weight"))
    run_train(2, dump, *qwen)  # resumes the TP checkpoint under FSDP
    want, got = read_metrics(ref), read_metrics(dump)
    assert sorted(got) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert abs(got[step]["loss"] - want[step]["loss"]) / want[step]["loss"] < 1e-3, step


def test_dcpkit_train_command_launches_torchrun(tmp_path):
    dump = tmp_path / "cli"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcpkit.cli",
            "train",
            "--nproc-per-node",
            "2",
            "--job.config_file",
            str(CONFIG),
            "--job.dump_folder",
            str(dump),
            "--training.steps",
            "3",
            "--checkpoint.interval",
            "2",
        ],
        env=torchrun_env(),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step    3" in proc.stdout
    assert sorted(read_metrics(dump)) == [1, 2, 3]
    assert open_store(dump / "checkpoint").published_steps() == [2, 3]


def test_trainer_initial_load_in_hf_and_last_save_in_hf(stopped_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from dcpkit.convert.hf import from_hf, to_hf

    hf = tmp_path / "hf"
    to_hf(
        stopped_run / "checkpoint" / "step-10",
        hf,
        "llama3",
        "debugmodel",
        tokenizer=stopped_run / "tokenizer.json",
    )
    imported = tmp_path / "imported"
    from_hf(hf, imported, "llama3")

    from_hf_run = tmp_path / "from_hf"
    proc = run_train(
        2,
        from_hf_run,
        "--training.steps",
        "2",
        "--checkpoint.initial_load_path",
        str(hf),
        "--checkpoint.initial_load_in_hf",
        "true",
        "--checkpoint.last_save_model_only",
        "true",
        "--checkpoint.last_save_in_hf",
        "true",
        "--checkpoint.export_dtype",
        "bfloat16",
    )
    assert "initial_load_path" in proc.stdout
    from_dcp_run = tmp_path / "from_dcp"
    run_train(
        2, from_dcp_run, "--training.steps", "1", "--checkpoint.initial_load_path", str(imported)
    )
    # Both start from the step-10 weights (optimizer fresh, data from the start).
    a, b = read_metrics(from_hf_run), read_metrics(from_dcp_run)
    assert a[1]["loss"] == b[1]["loss"]
    assert a[1]["loss"] < read_metrics(stopped_run)[1]["loss"] - 0.3

    final = from_hf_run / "checkpoint" / "step-2"
    assert (final / "model.safetensors.index.json").is_file()
    assert open_store(from_hf_run / "checkpoint").published_steps() == [2]
    model = AutoModelForCausalLM.from_pretrained(str(final))
    assert model.config.torch_dtype == torch.bfloat16 or model.dtype == torch.bfloat16


def test_seed_checkpoint_then_training_starts_from_it(tmp_path):
    dump = tmp_path / "seeded"
    proc = run_train(1, dump, "--checkpoint.create_seed_checkpoint", "true", "--training.seed", "7")
    assert "seed checkpoint written" in proc.stdout
    assert open_store(dump / "checkpoint").published_steps() == [0]
    manifest = read_manifest(dump / "checkpoint" / "step-0")
    assert manifest["model_only"] and manifest["world_size"] == 1
    # 2 ranks with another seed: the weights come from the seed checkpoint (model only), and
    # training starts at step 1.
    proc = run_train(2, dump, "--training.steps", "2", "--training.seed", "0")
    assert "step-0" in proc.stdout and "model)" in proc.stdout
    seeded = read_metrics(dump)
    plain = tmp_path / "plain"
    run_train(2, plain, "--training.steps", "2", "--training.seed", "0")
    assert sorted(seeded) == [1, 2]
    assert seeded[1]["loss"] != read_metrics(plain)[1]["loss"]
    # The same seed checkpoint gives the same start at another world size.
    again = tmp_path / "again"
    shutil.copytree(dump / "checkpoint" / "step-0", again / "checkpoint" / "step-0")
    run_train(1, again, "--training.steps", "1", "--training.seed", "0")
    assert abs(read_metrics(again)[1]["loss"] - seeded[1]["loss"]) < 1e-5
