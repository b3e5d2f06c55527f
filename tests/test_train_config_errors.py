"""Bad configuration stops the trainer at start with a message naming the option."""

from __future__ import annotations

import subprocess

import pytest

from conftest import CONFIG, copy_checkpoint, rank_pool, torchrun_env


def _trainer(*args: str) -> subprocess.CompletedProcess:
    """``python -m dcpkit.train ARGS`` on one rank (of the rank pool: a bad setting stops the
    trainer before its process group, as it would in a process of its own)."""
    return rank_pool().run(1, "train", "", list(args), torchrun_env(), 300)


def _train(*args: str) -> subprocess.CompletedProcess:
    return _trainer("--job.config_file", str(CONFIG), *args)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--bogus.option", "1"], "unknown section [bogus]"),
        (["--training.nonsense", "1"], "unknown option [training] nonsense"),
        (["--checkpoint.keep_latest_k", "1"], "[checkpoint] keep_latest_k = 1"),
        (["--checkpoint.keep_latest_k", "-3"], "[checkpoint] keep_latest_k = -3"),
        (["--checkpoint.interval", "0"], "[checkpoint] interval"),
        (["--checkpoint.async_mode", "sometimes"], "[checkpoint] async_mode 'sometimes'"),
        (["--checkpoint.exclude_from_loading", "model"], "exclude_from_loading may not contain"),
        (["--checkpoint.enable", "maybe"], "[checkpoint] enable must be true or false"),
        (["--parallelism.data_parallel_shard_degree", "2"], "data_parallel_shard_degree (2)"),
        (["--parallelism.tensor_parallel_degree", "3"], "tensor_parallel_degree = 3"),
        (["--training.global_batch_size", "0"], "[training] global_batch_size must be >= 1"),
    ],
)
def test_bad_option_is_named(tmp_path, args, expected):
    proc = _train("--job.dump_folder", str(tmp_path), *args)
    assert proc.returncode != 0
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_exclude_from_loading_key(tmp_path):
    proc = _train(
        "--job.dump_folder", str(tmp_path), "--checkpoint.exclude_from_loading", "optimizer,weather"
    )
    assert proc.returncode != 0
    assert "[checkpoint] exclude_from_loading names 'weather'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_load_step(tmp_path, stopped_run):
    copy_checkpoint(stopped_run, 10, tmp_path)
    proc = _train("--job.dump_folder", str(tmp_path), "--checkpoint.load_step", "7")
    assert proc.returncode != 0
    assert "[checkpoint] load_step = 7" in proc.stderr
    assert "published steps: 10" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_toml_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[checkpoint]\ninterval = \n")
    proc = _trainer("--job.config_file", str(bad))
    assert proc.returncode != 0 and "is not valid TOML" in proc.stderr


def test_every_rank_that_fails_says_why(monkeypatch, capsys):
    """A rank other than 0 that stops on a bad setting prints the reason too, with its rank: the
    first rank to exit makes torchrun stop the rest, rank 0 perhaps before it has printed."""
    from dcpkit.train import trainer

    monkeypatch.setattr(trainer.dist, "rank", lambda: 1)
    assert trainer.main(["--job.config_file", str(CONFIG), "--checkpoint.interval", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("[rank 1] error: ") and "[checkpoint] interval" in err, err
