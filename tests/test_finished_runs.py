"""A finished run started again on its own folder: its model-only last save (DCP or Hugging
Face) is never resumed as a full checkpoint, and nothing the first run wrote is overwritten
unless a resume from an earlier step asks for it (then each replacement is logged)."""

from __future__ import annotations

import hashlib

import pytest

from conftest import read_metrics, run_train

pytestmark = pytest.mark.dist

RUN = ("--training.steps", "6", "--checkpoint.interval", "3")
HF_LAST = ("--checkpoint.last_save_in_hf", "true", "--checkpoint.last_save_model_only", "true")


def _files(dump):
    root = dump / "checkpoint"
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.name.startswith(".lease")
    }


@pytest.fixture(scope="module")
def finished_hf_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("finished-hf")
    run_train(2, dump, *RUN, *HF_LAST)
    assert (dump / "checkpoint" / "step-6" / "config.json").exists()
    return dump


@pytest.mark.parametrize("extra", [(), ("--checkpoint.load_step", "6")], ids=["latest", "step6"])
def test_rerunning_a_finished_hf_run_stops_and_changes_nothing(finished_hf_run, extra):
    before = _files(finished_hf_run)
    proc = run_train(2, finished_hf_run, *RUN, *HF_LAST, *extra, check=False)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "step-6" in out and "is a model-only save" in out
    assert "set load_step = 3 (its newest full checkpoint)" in out
    assert "initial_load_in_hf = true" in out
    assert "step    1 |" not in out  # not a single step trained
    assert _files(finished_hf_run) == before


def test_load_model_only_loads_it_but_never_overwrites_the_first_run(finished_hf_run):
    before = _files(finished_hf_run)
    proc = run_train(
        2, finished_hf_run, *RUN, *HF_LAST, "--checkpoint.load_model_only", "true", check=False
    )
    out = proc.stdout + proc.stderr
    assert "step-6 (latest published step" in out and "; model)" in out  # loaded, model only
    assert proc.returncode != 0
    assert "step-3 is already published in this checkpoint folder by an earlier run" in out
    assert _files(finished_hf_run) == before


def test_extending_from_the_last_full_checkpoint_replaces_later_steps_with_a_log(
    finished_hf_run, tmp_path
):
    import shutil

    dump = tmp_path / "extended"
    shutil.copytree(finished_hf_run, dump)
    proc = run_train(
        2, dump, "--training.steps", "9", "--checkpoint.interval", "3",
        "--checkpoint.load_step", "3",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "replacing the published step-6" in out
    assert "resuming after step 3" in out
    assert 9 in read_metrics(dump)
    assert (dump / "checkpoint" / "step-6" / ".metadata").exists()  # a full step-6 now


def test_rerunning_a_finished_dcp_model_only_run_stops_and_changes_nothing(tmp_path):
    model_only = (*RUN, "--checkpoint.last_save_model_only", "true")
    run_train(1, tmp_path, *model_only)
    before = _files(tmp_path)
    proc = run_train(1, tmp_path, *model_only, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "is a model-only save" in out
    assert "initial_load_in_hf" not in out
    assert _files(tmp_path) == before
