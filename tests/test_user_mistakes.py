"""A user's mistakes said before training, in one paragraph naming the path and the fix: the
checkpoint folder (or one of its steps) given where the run's folder was meant, a file given as
a folder, checkpointing left off, a configuration error under ``dcpkit train``."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import CONFIG, cli, copy_checkpoint, run_train
from dcpkit import CheckpointConfig, CheckpointManager, ConfigError


@pytest.fixture
def used_run(tmp_path):
    """A run's folder whose checkpoint folder holds steps 1 and 2."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(CheckpointConfig(enable=True, interval=1), tmp_path / "run", model) as m:
        m.save(1)
        m.save(2)
    return tmp_path / "run"


@pytest.mark.parametrize(
    "given, said",
    [
        ("checkpoint", "is itself a checkpoint folder (it holds step-1, step-2)"),
        ("checkpoint/step-2", "is a step of the checkpoint folder"),
        ("checkpoint/elsewhere", "lies inside the checkpoint folder"),
    ],
)
def test_a_checkpoint_folder_given_as_the_run_folder_is_refused_naming_the_run(
    used_run, given, said
):
    config = CheckpointConfig(enable=True, interval=1)
    with pytest.raises(ConfigError) as refused:
        CheckpointManager(config, used_run / given, torch.nn.Linear(2, 2))
    text = str(refused.value)
    assert said in text and f"did you mean {used_run}?" in text, text
    assert not (used_run / given / "checkpoint").exists()  # nothing made there
    with CheckpointManager(config, used_run, torch.nn.Linear(2, 2)) as manager:
        assert manager.load() == 2  # the folder meant resumes as before


def test_a_file_given_as_the_base_folder_is_named_as_a_file(tmp_path):
    afile = tmp_path / "run.txt"
    afile.write_text("notes")
    with pytest.raises(ConfigError, match=r"run\.txt: the base folder is a file, not a folder"):
        CheckpointManager(CheckpointConfig(enable=True), afile, torch.nn.Linear(2, 2))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint").write_text("")
    with pytest.raises(ConfigError, match="the checkpoint folder is a file, not a folder"):
        CheckpointManager(CheckpointConfig(enable=True), tmp_path / "run", torch.nn.Linear(2, 2))


@pytest.mark.dist
def test_the_trainer_refuses_a_checkpoint_folder_before_its_first_step(stopped_run, tmp_path):
    copy_checkpoint(stopped_run, 10, tmp_path / "run")
    proc = run_train(2, tmp_path / "run" / "checkpoint", check=False)
    assert proc.returncode != 0
    assert f"did you mean {tmp_path / 'run'}?" in proc.stderr, proc.stderr[-2000:]
    assert "step    1" not in proc.stdout  # refused before training
    afile = tmp_path / "notes.txt"
    afile.write_text("")
    proc = run_train(2, afile, check=False)
    assert proc.returncode != 0 and "notes.txt" in proc.stderr and "is a file" in proc.stderr


def test_checkpointing_off_is_said_once_at_start(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dcpkit"):
        CheckpointManager(CheckpointConfig(), tmp_path, torch.nn.Linear(2, 2))
    said = [r.getMessage() for r in caplog.records if "checkpointing is off" in r.getMessage()]
    assert len(said) == 1 and "enable = true" in said[0], said
    proc = run_train(1, tmp_path / "off", "--checkpoint.enable", "false", "--training.steps", "1")
    said = [x for x in proc.stdout.splitlines() if "checkpointing is off" in x]
    assert len(said) == 1 and "[checkpoint] enable = true" in said[0], proc.stdout
    assert proc.stdout.index("checkpointing is off") < proc.stdout.index("step    1")


@pytest.mark.parametrize(
    "args, said",
    [
        (["--checkpont.interval", "5"], "unknown section [checkpont]; known sections:"),
        (["--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree = 3 does not"),
    ],
)
def test_dcpkit_train_says_a_config_error_once_before_any_rank_starts(args, said):
    proc = cli("train", "--nproc-per-node", "2", "--job.config_file", str(CONFIG), *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("dcpkit train: error: ") and said in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1  # one paragraph: no rank started, no torchrun report


def test_a_polling_loop_says_the_same_latest_once(tmp_path, caplog):
    """`latest` asked again and again (an evaluation job's loop): said when it changes."""
    import dcpkit

    model = torch.nn.Linear(2, 2)
    config = CheckpointConfig(enable=True, interval=1)
    folder = tmp_path / "run" / "checkpoint"
    with CheckpointManager(config, tmp_path / "run", model) as manager:
        manager.save(1)
        caplog.set_level(logging.INFO, logger="dcpkit")
        for _ in range(5):
            with dcpkit.reading(folder, step="latest") as held:
                assert held.name == "step-1"
        manager.save(2)
        for _ in range(3):
            with dcpkit.reading(folder, step="latest") as held:
                assert held.name == "step-2"
    said = [r.getMessage() for r in caplog.records if "`latest` of" in r.getMessage()]
    assert [x.split(" is ")[1].split(",")[0] for x in said] == ["step-1", "step-2"], said


def test_a_used_folder_saved_into_without_a_load_is_refused_at_the_first_step(used_run):
    """save() before load() on a folder with published steps: refused at the first call (step
    1, whether or not it saves), not ``interval`` steps later; a load first resumes as ever,
    and steps before the run's own (a seed checkpoint, step 0) are no obstacle."""
    from dcpkit import CheckpointError

    config = CheckpointConfig(enable=True, interval=5)
    refused = pytest.raises(CheckpointError, match=r"up to step-2\) and this run saves step 1 ")
    with CheckpointManager(config, used_run, torch.nn.Linear(2, 2)) as manager, refused:
        manager.save(1)  # not a step the policy saves: refused all the same
    assert sorted(p.name for p in (used_run / "checkpoint").glob("step-*")) == ["step-1", "step-2"]
    with CheckpointManager(config, used_run, torch.nn.Linear(2, 2)) as manager:
        assert manager.load() == 2
        assert manager.save(5) and manager.save(6) is False
    with CheckpointManager(config, used_run, torch.nn.Linear(2, 2)) as manager:
        assert manager.save(10)  # after every published step: nothing to interleave with
