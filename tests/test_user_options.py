"""Every option a user sets, however it arrives (Python, TOML, the command line), is checked where
it enters by one set of rules; what the run will need later is checked before it trains; and
the smaller ways a user's setup went wrong get a message that says what to do."""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch

from conftest import cli, run_script, run_train
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager, ConfigError
from dcpkit.train.config import load_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"interval": "5"}, r"\[checkpoint\] interval must be an integer, got '5'"),
        ({"interval": 5.0}, r"\[checkpoint\] interval must be an integer, got 5.0"),
        ({"enable": "yes"}, r"\[checkpoint\] enable must be true or false, got 'yes'"),
        ({"keep_latest_k": True}, r"\[checkpoint\] keep_latest_k must be an integer"),
        ({"exclude_from_loading": "optimizer"}, r"exclude_from_loading must be a list"),
        ({"exclude_from_loading": [1]}, r"exclude_from_loading must be a string, got 1"),
        ({"storage_options": "x"}, r"storage_options must be a table"),
        ({"lease_timeout_s": "60"}, r"lease_timeout_s must be a number"),
        ({"initial_load_in_hf": True}, r"initial_load_in_hf = true, but initial_load_path is"),
    ],
)
def test_the_constructor_checks_every_type(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig(**kwargs)


def test_the_constructor_takes_what_a_user_naturally_passes():
    cfg = CheckpointConfig(folder=pathlib.Path("/tmp/ckpt"), lease_timeout_s=30)
    assert cfg.folder == "/tmp/ckpt" and cfg.lease_timeout_s == 30.0
    assert isinstance(cfg.lease_timeout_s, float)
    assert CheckpointConfig(exclude_from_loading=("optimizer",)).exclude_from_loading == [
        "optimizer"
    ]


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('interval = "5"', r"interval must be an integer, got '5'"),
        ("interval = 5.0", r"interval must be an integer, got 5.0"),
        ('enable = "true"', r"enable must be true or false, got 'true'"),
    ],
)
def test_toml_values_follow_the_same_rules(tmp_path, line, match):
    path = tmp_path / "c.toml"
    path.write_text(f"[checkpoint]\n{line}\n")
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig.from_toml(path)
    with pytest.raises(ConfigError, match=match):
        load_config(["--job.config_file", str(path)])


def test_a_toml_syntax_error_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[checkpoint]\ninterval = \n")
    for load in (CheckpointConfig.from_toml, lambda p: load_config(["--job.config_file", p])):
        with pytest.raises(ConfigError, match=rf"{path}.* is not valid TOML: .*line 2"):
            load(str(path))


@pytest.mark.parametrize(
    "value",
    ['["optimizer","lr_scheduler"]', "['optimizer', 'lr_scheduler']", "optimizer,lr_scheduler"],
)
def test_list_options_take_json_toml_or_commas_on_the_command_line(value):
    cfg = load_config(["--checkpoint.exclude_from_loading", value, "--checkpoint.interval", "5"])
    assert cfg.checkpoint.exclude_from_loading == ["optimizer", "lr_scheduler"]
    assert cfg.checkpoint.interval == 5


def test_a_second_manager_on_a_folder_already_saved_to_is_refused(tmp_path):
    cfg = CheckpointConfig(enable=True, interval=1)
    first = CheckpointManager(cfg, tmp_path, torch.nn.Linear(2, 2))
    second = CheckpointManager(cfg, tmp_path, torch.nn.Linear(3, 3))  # nothing saved yet: fine
    assert first.save(1)
    with pytest.raises(CheckpointError, match="another CheckpointManager of this process"):
        second.save(2)
    with pytest.raises(CheckpointError, match="another CheckpointManager of this process"):
        CheckpointManager(cfg, tmp_path, torch.nn.Linear(3, 3))
    assert first.published_steps() == [1]
    first.close()
    with CheckpointManager(cfg, tmp_path, torch.nn.Linear(2, 2)) as third:  # closed: free
        assert third.load() == 1
    other = CheckpointConfig(enable=True, interval=1, folder="other")
    with CheckpointManager(other, tmp_path, torch.nn.Linear(3, 3)) as own_folder:
        assert own_folder.save(1)
    second.close()


def test_last_save_in_hf_is_checked_before_training(tmp_path):
    from dcpkit import HFModel

    cfg = CheckpointConfig(enable=True, last_save_in_hf=True)
    model = torch.nn.Linear(4, 4)  # parameters the llama3 family cannot name
    expected = r"last_save_in_hf = true, but the model .* lacks 57 llama3 debugmodel param"
    with pytest.raises(ConfigError, match=expected):
        CheckpointManager(cfg, tmp_path, model, hf_model=HFModel("llama3", "debugmodel"))
    with pytest.raises(ConfigError, match=r"pass hf_model=HFModel"):
        CheckpointManager(cfg, tmp_path, model)


def test_initial_load_path_at_a_hugging_face_folder_says_to_set_initial_load_in_hf(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"")
    cfg = CheckpointConfig(enable=True, initial_load_path=str(hf))
    mgr = CheckpointManager(cfg, tmp_path, torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match=r"is a Hugging Face folder .*set initial_load_in_hf"):
        mgr.load()
    mgr.close()


@pytest.mark.dist
def test_a_script_without_a_main_guard_saves_with_the_writer_process(tmp_path):
    proc = run_script(2, "no_main_guard.py", str(tmp_path / "ckpt"), timeout=120)
    assert "SAVED [1, 2]" in proc.stdout


@pytest.mark.dist
def test_trainer_takes_a_json_list_for_exclude_from_loading(stopped_run, tmp_path):
    dump = tmp_path / "run"
    shutil.copytree(stopped_run / "checkpoint" / "step-10", dump / "checkpoint" / "step-10")
    proc = run_train(
        2, dump, "--training.stop_at_step", "11",
        "--checkpoint.exclude_from_loading", '["optimizer","lr_scheduler"]',
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "not loading 'optimizer'" in out or "exclude_from_loading" in out
    assert "resuming after step 10" in out
    assert cli("list", str(dump / "checkpoint")).returncode == 0


def test_initial_load_in_hf_loads_every_parameter_or_names_the_missing(tmp_path):
    """A Hugging Face folder starts the model whole, or the load names what it lacks (never a
    model left partly at its initial weights)."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from dcpkit import CheckpointError, HFModel

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    torch.manual_seed(1)
    model = LlamaForCausalLM(config)
    cfg = CheckpointConfig(enable=True, initial_load_path=str(tmp_path / "hf"),
                           initial_load_in_hf=True)  # fmt: skip
    mgr = CheckpointManager(cfg, tmp_path / "a", model, hf_model=HFModel("hf", config))
    mgr.load()
    mgr.close()
    saved = load_file(tmp_path / "hf" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items())
    del saved["lm_head.weight"]
    save_file(saved, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    mgr = CheckpointManager(cfg, tmp_path / "b", LlamaForCausalLM(config),
                            hf_model=HFModel("hf", config))  # fmt: skip
    with pytest.raises(CheckpointError, match=r"does not hold 1 of this model's parameters \(lm"):
        mgr.load()
    mgr.close()
