"""Every layout TorchTitan trains with: pipeline stages (1F1B and interleaved) and HSDP, combined
with FSDP and TP, saved under plain parameter names and resumed at any other layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import cli, read_metrics, run_train
from dcpkit.safe_pickle import load_metadata

pytestmark = pytest.mark.dist

STEPS = ("--training.steps", "8", "--checkpoint.interval", "4")
PP2 = ("--parallelism.pipeline_parallel_degree", "2")
INTERLEAVED = (*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B")
HSDP = (
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "2",
)
HF_LAST = ("--checkpoint.last_save_model_only", "true", "--checkpoint.last_save_in_hf", "true")


def _resume(src: Path, step: int, dst: Path, nproc: int, *layout: str) -> dict[int, dict]:
    (dst / "checkpoint").mkdir(parents=True)
    shutil.copytree(src / "checkpoint" / f"step-{step}", dst / "checkpoint" / f"step-{step}")
    proc = run_train(nproc, dst, *STEPS, *layout)
    assert "resuming after step 4" in proc.stdout
    return read_metrics(dst)


def _close(ref: dict[int, dict], got: dict[int, dict], steps, tol: float = 1e-3) -> None:
    for s in steps:
        a, b = ref[s]["loss"], got[s]["loss"]
        assert abs(a - b) <= tol * abs(a), (s, a, b)
        assert got[s]["tokens_seen"] == ref[s]["tokens_seen"]


def _model_chunks(step_folder: Path) -> dict[str, tuple[list[int], int]]:
    """Per model tensor: its shape and the number of elements its saved chunks cover."""
    with open(step_folder / ".metadata", "rb") as f:
        meta = load_metadata(f, str(step_folder))
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if key.split(".")[0] in ("optimizer", "rng", "dataloader", "lr_scheduler", "train_state"):
            continue
        if not hasattr(md, "chunks"):
            continue
        covered = sum(int(torch.Size(c.sizes).numel()) for c in md.chunks)
        out[key] = (list(md.size), covered)
    return out


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory) -> Path:
    """4 ranks, PP 2 x FSDP 2 (1F1B), 8 steps, checkpoints at 4 and a last save in HF at 8."""
    dump = tmp_path_factory.mktemp("pp2_fsdp2")
    proc = run_train(4, dump, *STEPS, *PP2, *HF_LAST)
    assert "pipeline: 2 stages (1F1B" in proc.stdout
    return dump


def test_pp_checkpoint_holds_every_parameter_once_under_its_plain_name(pp_run, tmp_path):
    chunks = _model_chunks(pp_run / "checkpoint" / "step-4")
    from dcpkit.models import build_model

    model = build_model("llama3", "debugmodel")
    expected = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert {k: v[0] for k, v in chunks.items()} == expected  # no stage prefixes, none missing
    for key, (shape, covered) in chunks.items():
        assert covered == torch.Size(shape).numel(), key  # each element saved exactly once
    # the HF last save, written by rank 0 from every stage's keys, loads in transformers
    hf = pp_run / "checkpoint" / "step-8"
    assert (hf / "config.json").is_file() and (hf / "model.safetensors.index.json").is_file()
    out = tmp_path / "hf"
    proc = cli(
        "to-hf",
        str(pp_run / "checkpoint" / "step-4"),
        str(out),
        "--model",
        "llama3",
        "--flavor",
        "debugmodel",
        "--verify",
    )
    assert proc.returncode == 0, proc.stderr
    assert "transformers logits of the export vs the source checkpoint" in proc.stdout


def test_pp_resumes_bitwise_at_the_same_layout(pp_run, tmp_path):
    ref = read_metrics(pp_run)
    got = _resume(pp_run, 4, tmp_path / "same", 4, *PP2)
    assert [got[s]["loss"] for s in range(5, 9)] == [ref[s]["loss"] for s in range(5, 9)]


@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ()),  # PP 1 x FSDP 2
        (1, ()),
        (4, ("--parallelism.pipeline_parallel_degree", "4")),
        (4, (*PP2, "--parallelism.tensor_parallel_degree", "2")),
    ],
    ids=["pp1_fsdp2", "one_rank", "pp4", "pp2_tp2"],
)
def test_pp_checkpoint_resumes_at_other_layouts(pp_run, tmp_path, nproc, layout):
    ref = read_metrics(pp_run)
    got = _resume(pp_run, 4, tmp_path / "other", nproc, *layout)
    _close(ref, got, range(5, 9))


def test_pp_checkpoint_diff_against_one_rank_shows_the_same_keys(pp_run, tmp_path):
    one = tmp_path / "one"
    (one / "checkpoint").mkdir(parents=True)
    shutil.copytree(pp_run / "checkpoint" / "step-4", one / "checkpoint" / "step-4")
    run_train(1, one, *STEPS, "--training.stop_at_step", "5")
    proc = cli("diff", str(pp_run / "checkpoint" / "step-4"), str(one / "checkpoint" / "step-5"))
    summary = proc.stdout.splitlines()[-1]
    assert "0 only in B, 0 changed shape or dtype" in summary, proc.stdout[-2000:]
    only = [line for line in proc.stdout.splitlines() if line.startswith("only in A")]
    # the only keys that differ are the RNG streams of ranks 1-3, which a 1-rank run has not
    assert only and all(line.startswith("only in A: rng.rank_") for line in only), only


@pytest.fixture(scope="module")
def interleaved_run(tmp_path_factory) -> Path:
    """4 ranks, PP 2 interleaved (2 stages per rank) x FSDP 2."""
    dump = tmp_path_factory.mktemp("interleaved")
    proc = run_train(4, dump, *STEPS, *INTERLEAVED)
    assert "this rank holds stages [0, 2]" in proc.stdout
    return dump


def test_interleaved_pp_matches_and_resumes(interleaved_run, pp_run, tmp_path):
    ref = read_metrics(interleaved_run)
    _close(read_metrics(pp_run), ref, range(1, 9))  # the same training, another schedule
    same = _resume(interleaved_run, 4, tmp_path / "same", 4, *INTERLEAVED)
    assert [same[s]["loss"] for s in range(5, 9)] == [ref[s]["loss"] for s in range(5, 9)]
    _close(ref, _resume(interleaved_run, 4, tmp_path / "flat", 2), range(5, 9))  # no PP


def test_hsdp_writes_balanced_saves_each_key_once_and_reshards(pp_run, tmp_path):
    hsdp = tmp_path / "hsdp"
    run_train(4, hsdp, *STEPS, *HSDP, "--training.stop_at_step", "4")
    step = hsdp / "checkpoint" / "step-4"
    written = {int(p.name.split("_")[2]): p.stat().st_size for p in step.glob("__*_0.distcp")}
    # mesh (dp_replicate, dp_shard): ranks 0-1 are replica 0, ranks 2-3 replica 1
    replicas = [written[0] + written[1], written[2] + written[3]]
    assert max(replicas) <= 1.10 * min(replicas), replicas
    for key, (shape, covered) in _model_chunks(step).items():
        assert covered == torch.Size(shape).numel(), key
    ref = read_metrics(pp_run)
    _close(ref, read_metrics(hsdp), range(1, 5))
    _close(ref, _resume(hsdp, 4, tmp_path / "fsdp4", 4), range(5, 9))
    _close(ref, _resume(hsdp, 4, tmp_path / "one", 1), range(5, 9))
