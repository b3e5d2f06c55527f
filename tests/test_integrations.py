"""dcpkit inside the frameworks' own training loops (the examples/ scripts, 2 processes, gloo):
a clean stop and a SIGKILL in the middle of a save, each resumed, every later loss equal to an
uninterrupted run's, bit for bit; what they wrote passes `dcpkit verify` and exports with
`dcpkit to-hf` to logits equal to the trained model's."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_base_linked, cli, run_python, run_ranks, torchrun_env

pytestmark = pytest.mark.dist


def run_example(
    cwd: Path,
    name: str | Path,
    *args: str,
    env: dict[str, str] | None = None,
    ok: bool = True,
    logs: list[str] | None = None,
) -> dict[int, str]:
    """The example's printed losses by step (its `step N loss X` lines); ``logs`` gets its
    output. ``name``: a script of examples/, or the path of one that runs it."""
    proc = run_ranks(2, ROOT / "examples" / name, *args, cwd=cwd, env=env)
    if ok:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    else:
        assert proc.returncode != 0, "the run was to be killed"
    if logs is not None:
        logs.append(proc.stdout + proc.stderr)
    return {int(m[0]): m[1] for m in re.findall(r"^step (\d+) loss (\S+)$", proc.stdout, re.M)}


def assert_resumed(full: dict[int, str], resumed: dict[int, str], first: int) -> None:
    assert sorted(resumed) == list(range(first, max(full) + 1)), sorted(resumed)
    differ = [s for s in resumed if resumed[s] != full[s]]
    assert differ == [], f"losses differ from the uninterrupted run's at steps {differ}"


def logits_of(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.fixture(scope="module")
def accelerate_full(tmp_path_factory):
    """An uninterrupted run of the Accelerate example: its losses and its folder."""
    cwd = tmp_path_factory.mktemp("accelerate-full")
    return run_example(cwd, "accelerate_loop.py"), cwd / "outputs" / "accelerate"


def test_accelerate_stopped_and_resumed_equals_uninterrupted(accelerate_full, tmp_path):
    full, _ = accelerate_full
    assert sorted(full) == list(range(1, 17))
    stopped = run_example(tmp_path, "accelerate_loop.py", "10")  # a clean stop, mid-epoch
    assert sorted(stopped) == list(range(1, 11))
    assert all(stopped[s] == full[s] for s in stopped)
    folder = tmp_path / "outputs" / "accelerate" / "checkpoint"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-10", "step-4", "step-8"]
    assert_resumed(full, run_example(tmp_path, "accelerate_loop.py"), 11)


def test_accelerate_lora_fine_tune_stopped_and_resumed_equals_uninterrupted(tmp_path):
    """The Accelerate example fine-tuning PEFT LoRA adapters (the base frozen, the optimizer
    given the adapters only; the base written once, linked by every later step): stopped
    mid-epoch and resumed, every loss the uninterrupted run's, bit for bit."""
    lora = {"LORA": "1"}
    (tmp_path / "full").mkdir()
    full = run_example(tmp_path / "full", "accelerate_loop.py", env=lora)
    assert sorted(full) == list(range(1, 17))
    assert_base_linked(tmp_path / "full" / "outputs" / "accelerate" / "checkpoint", 2)
    stopped = run_example(tmp_path, "accelerate_loop.py", "10", env=lora)
    assert all(stopped[s] == full[s] for s in stopped) and sorted(stopped) == list(range(1, 11))
    assert_resumed(full, run_example(tmp_path, "accelerate_loop.py", env=lora), 11)


def test_accelerate_killed_mid_save_resumes_from_the_last_published_step(accelerate_full, tmp_path):
    full, _ = accelerate_full
    run_example(tmp_path, "accelerate_loop.py", env={"DCPKIT_FAILPOINT": "mid_write:8"}, ok=False)
    folder = tmp_path / "outputs" / "accelerate" / "checkpoint"
    assert [p.name for p in folder.glob("step-*")] == ["step-4"]  # step 8 never published
    assert_resumed(full, run_example(tmp_path, "accelerate_loop.py"), 5)


def test_accelerate_checkpoint_verifies_and_exports_the_trained_model(accelerate_full, tmp_path):
    _, out = accelerate_full
    step = out / "checkpoint" / "step-16"
    proc = cli("verify", str(step))
    assert proc.returncode == 0 and "sizes and checksums of" in proc.stdout, proc.stdout
    proc = cli("to-hf", str(step), str(tmp_path / "hf"), "--verify")  # the manifest says how
    assert proc.returncode == 0, proc.stderr
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    exported, trained = logits_of(tmp_path / "hf", tokens), logits_of(out / "final", tokens)
    assert torch.equal(exported, trained)  # Accelerate's own save_pretrained of the same model


@pytest.mark.parametrize(
    "stateful,match",
    [(False, "use_stateful_dataloader=True"), (True, "use_seedable_sampler=True")],
)
def test_accelerate_refuses_a_dataloader_whose_position_would_be_lost(stateful, match, tmp_path):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from dcpkit.integrations.accelerate import AcceleratorCheckpoint

    config = DataLoaderConfiguration(use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    model = torch.nn.Linear(2, 2)
    loader = accelerator.prepare(torch.utils.data.DataLoader(torch.zeros(8, 2), shuffle=True))
    with pytest.raises(TypeError, match=match):
        AcceleratorCheckpoint(accelerator, tmp_path, model, dataloader=loader)
    assert not (tmp_path / "checkpoint").exists()  # refused before anything was written


def _epochs_run(folder: Path, *args: str, env: dict[str, str] | None = None, ok: bool = True):
    """``tests/scripts/accelerate_epochs.py``'s lines by (rank, step): (loss, mine, shared)."""
    script = ROOT / "tests" / "scripts" / "accelerate_epochs.py"
    proc = run_ranks(2, script, str(folder), *args, env=env)
    assert (proc.returncode == 0) == ok, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.findall(
        r"^rank (\d) step (\d+) loss (\S+) mine (\d+) shared (\d+)", proc.stdout, re.M
    )
    return {(int(r), int(s)): (loss, int(m), int(c)) for r, s, loss, m, c in found}


def test_accelerate_resumes_exactly_in_every_epoch(tmp_path):
    """A user's Accelerate loop (seedable sampler, stateful dataloader, 2 micro-batches per
    step, 6 batches per epoch) stopped at the last step of its 1st epoch (step 6), in its 2nd
    (step 10), at the last step of its 2nd (step 12), killed in the middle of a save in its 3rd
    (step 16, step 14 published) and run to the end: every
    later loss on both ranks is the uninterrupted run's, bit for bit; so are a per-rank state
    (``per_rank_states=``) and an object given to ``register_for_checkpointing``. Accelerate's
    dataloader sets its sampler's epoch from its own count of epochs, which dcpkit keeps. The
    uninterrupted run is the same loop's without dcpkit, bit for bit."""
    full = _epochs_run(tmp_path / "full")
    assert sorted({s for _, s in full}) == list(range(1, 23))
    # checkpointing changes nothing: the same loop without dcpkit, bit for bit
    assert _epochs_run(tmp_path / "plain", env={"PLAIN": "1"}) == full
    folder = tmp_path / "stopped"
    seen = _epochs_run(folder, "6")
    for stop in ("10", "12"):
        seen.update(_epochs_run(folder, stop))
    killed = _epochs_run(folder, env={"DCPKIT_FAILPOINT": "mid_write:16"}, ok=False)
    assert max(s for _, s in killed) >= 16  # the save is asynchronous: training goes on
    assert max(int(p.name[5:]) for p in (folder / "checkpoint").glob("step-*")) == 14
    seen.update(killed)
    rest = _epochs_run(folder)
    assert min(s for _, s in rest) == 15 and max(s for _, s in rest) == 22
    seen.update(rest)
    for key, value in full.items():
        assert seen[key] == value, (key, seen[key], value)


def test_accelerate_refuses_a_save_inside_an_accumulated_step_and_a_late_registration(tmp_path):
    from accelerate import Accelerator

    from dcpkit.integrations.accelerate import AcceleratorCheckpoint

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    ckpt = AcceleratorCheckpoint(accelerator, tmp_path, model)
    try:
        with accelerator.accumulate(model):  # the first of 2 micro-batches
            model(torch.ones(1, 2)).sum().backward()
        assert not accelerator.sync_gradients
        with pytest.raises(ValueError, match="inside an accumulated step"):
            ckpt.save_state(1, force=True)
        model.zero_grad()
        accelerator.register_for_checkpointing(torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=r"SGD was given to accelerator\.register_for_check"):
            ckpt.save_state(2, force=True)
        assert not list((tmp_path / "checkpoint").glob("step-*"))
    finally:
        ckpt.close()


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def lightning_full(request, tmp_path_factory):
    """An uninterrupted run of the Lightning example (DDP, or FSDP2 under dcpkit's
    ModelParallelStrategy): its strategy, losses and folder."""
    cwd = tmp_path_factory.mktemp(f"lightning-{request.param}")
    env = {"STRATEGY": request.param}
    return env, run_example(cwd, "lightning_loop.py", env=env), cwd / "outputs" / "lightning"


def test_lightning_stopped_and_resumed_equals_uninterrupted(lightning_full, tmp_path):
    env, full, out = lightning_full
    assert sorted(full) == list(range(1, 33))
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(names) == 3 and "last.ckpt" in names  # ModelCheckpoint's top 2, and last
    stopped = run_example(tmp_path, "lightning_loop.py", "2", env=env)  # after 2 of 4 epochs
    assert sorted(stopped) == list(range(1, 17))
    assert all(stopped[s] == full[s] for s in stopped)
    assert_resumed(full, run_example(tmp_path, "lightning_loop.py", env=env), 17)


def test_lightning_killed_mid_save_resumes_from_the_last_published_checkpoint(
    lightning_full, tmp_path
):
    env, full, _ = lightning_full
    kill = {**env, "DCPKIT_FAILPOINT": "mid_write:16"}  # the first save of step 16 (epoch 2)
    run_example(tmp_path, "lightning_loop.py", env=kill, ok=False)
    folder = tmp_path / "outputs" / "lightning" / "checkpoints"
    published = sorted(p.name for p in folder.glob("[!.]*.ckpt"))
    assert published == ["epoch=0-step=8.ckpt", "last.ckpt"]  # and the pending one, never read
    assert_resumed(full, run_example(tmp_path, "lightning_loop.py", env=env), 9)


def test_lightning_resumes_bitwise_from_a_save_at_an_epoch_s_last_batch(lightning_full, tmp_path):
    """``ModelCheckpoint(every_n_train_steps=8)`` saves at each epoch's last batch (8 batches
    an epoch), from ``on_train_batch_end``, before the epoch ends; a run killed in the save of
    step 16 resumes from step 8 with epoch 2's data order and dropout as the uninterrupted
    run's. (DDP; FSDP2's epoch-end resume is the test above.)"""
    env, full, _ = lightning_full
    if env["STRATEGY"] != "ddp":
        pytest.skip("one strategy is enough for Lightning's loop; FSDP2 resumes in the test above")
    env = {**env, "SAVE_EVERY_N_STEPS": "8"}
    run_example(tmp_path, "lightning_loop.py", env={**env, "DCPKIT_FAILPOINT": "mid_write:16"},
                ok=False)  # fmt: skip
    folder = tmp_path / "outputs" / "lightning" / "checkpoints"
    published = sorted(p.name for p in folder.glob("[!.]*.ckpt"))
    assert published == ["epoch=0-step=8.ckpt", "last.ckpt"]
    assert_resumed(full, run_example(tmp_path, "lightning_loop.py", env=env), 9)


def test_lightning_checkpoint_verifies_and_exports_the_trained_model(lightning_full, tmp_path):
    _, _, out = lightning_full
    last = out / "checkpoints" / "last.ckpt"
    proc = cli("verify", str(last))
    assert proc.returncode == 0 and "sizes and checksums of" in proc.stdout, proc.stdout
    proc = cli("inspect", str(last))
    assert proc.returncode == 0 and "model.layers.0.self_attn.q_proj.weight" in proc.stdout
    listed = cli("list", str(out / "checkpoints")).stdout
    assert re.search(
        r"^last\.ckpt +\d+ .*published, \d rank\(s\); sizes and structure verified", listed, re.M
    ), listed
    assert re.search(r"^epoch=\d+-step=\d+\.ckpt +\d+ ", listed, re.M), listed
    proc = cli("to-hf", str(last), str(tmp_path / "hf"), "--verify")
    assert proc.returncode == 0, proc.stderr
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(logits_of(tmp_path / "hf", tokens), logits_of(out / "final", tokens))


@pytest.mark.parametrize(
    "point,how",
    [
        ("before_publish", "swap"),
        ("mid_publish", "swap"),
        ("after_publish", "swap"),
        ("mid_publish", "renames"),  # before and after it, the same steps as a swap's
    ],
)
def test_a_rewrite_of_last_ckpt_killed_at_any_step_leaves_a_checkpoint_there(tmp_path, point, how):
    """``last.ckpt`` rewritten (global step 2 over 1) and the process SIGKILLed before, in the
    middle of and after the publish: a checkpoint is at ``last.ckpt`` for Lightning's listing
    to find (with the exchange of two folders: at every moment), and loads whole, step 1 or 2.
    With two renames instead (a file system without the exchange) the kill between them leaves
    no ``last.ckpt``, and dcpkit's next look at that path finishes the publish."""
    from dcpkit.integrations.lightning import DcpCheckpointIO

    script = ROOT / "tests" / "scripts" / "lightning_rewrite.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), how],
        env=torchrun_env({"DCPKIT_FAILPOINT": f"{point}:2"}), capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == -9 and "saved 1" in proc.stdout, proc.stderr[-2000:]
    last = tmp_path / "last.ckpt"
    torn = how == "renames" and point == "mid_publish"
    assert last.is_dir() != torn, sorted(p.name for p in tmp_path.iterdir())
    back = DcpCheckpointIO().load_checkpoint(last)  # verified first
    want = 1 if point == "before_publish" else 2
    assert back["global_step"] == want
    assert torch.equal(back["state_dict"]["w"], torch.full((4, 4), float(want)))
    assert cli("verify", str(last)).returncode == 0
    if point != "mid_publish":
        return
    # the next rewrites go on from what the kill left, and leave nothing beside last.ckpt
    run = run_python(script, str(tmp_path), how)
    assert run.returncode == 0 and DcpCheckpointIO().load_checkpoint(last)["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing left beside
    listed = cli("list", str(tmp_path))  # Lightning's names, listed and verified
    assert listed.returncode == 0 and re.search(r"^last\.ckpt +3 .*verified", listed.stdout, re.M)


def test_lightning_modules_load_from_dcpkit_checkpoints(tmp_path):
    """``load_from_checkpoint`` of a dcpkit checkpoint folder (Lightning's own opens one file):
    the helper, and the mixin's classmethod, build the module from its saved hyperparameters
    and load the trained parameters; the mixin still reads Lightning's own ``.ckpt`` files."""
    import lightning as L

    from dcpkit.integrations.lightning import DcpCheckpointIO
    from dcpkit.integrations.lightning_loading import LoadsDcpCheckpoints, load_from_checkpoint

    class Tiny(LoadsDcpCheckpoints, L.LightningModule):
        def __init__(self, width: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(width, 1)

        def training_step(self, batch, _):
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.randn(8, 5), batch_size=4)
    for plugins, folder in (([DcpCheckpointIO()], "dcp"), ([], "own")):
        torch.manual_seed(0)
        model = Tiny(width=5)
        trainer = L.Trainer(
            max_steps=3, accelerator="cpu", devices=1, plugins=plugins, logger=False,
            default_root_dir=tmp_path / folder, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(model, data)
        path = trainer.checkpoint_callback.best_model_path
        assert Path(path).is_dir() == (folder == "dcp")  # dcpkit's: a folder
        for loaded in ((load_from_checkpoint(Tiny, path),) if folder == "dcp" else ()) + (
            Tiny.load_from_checkpoint(path),
        ):
            assert loaded.hparams.width == 5
            assert torch.equal(loaded.layer.weight, model.layer.weight)
    assert Path(path).is_file()  # the last one: Lightning's own file


def test_lightning_fsdp2_with_async_checkpoint_io_is_refused_before_training():
    """What the Frameworks page once said to do for async saves under FSDP2 is refused when
    the strategy is set up, before the first step, naming the reason and what works."""
    script = ROOT / "tests" / "scripts" / "lightning_async_fsdp.py"
    proc = run_python(script)
    assert "REFUSED after 0 steps" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cannot save through AsyncCheckpointIO" in proc.stdout
    assert 'plugins=[DcpCheckpointIO(async_mode="async")] instead' in proc.stdout


def test_lightning_fsdp2_saves_in_the_background_and_resumes_bitwise(lightning_full, tmp_path):
    """``DcpCheckpointIO(async_mode=...)`` under dcpkit's ModelParallelStrategy (FSDP2): the run
    stopped after 2 epochs saved in the background (``async``, a writer thread per process) and
    its last save was written before ``fit`` returned (``last.ckpt`` is step 16); resumed with
    ``async_with_pinned_mem`` (a writer process per rank), every loss is the uninterrupted
    synchronous run's, bit for bit. Under DDP the mode is refused at the save (Lightning
    saves from rank 0 alone there; its AsyncCheckpointIO is the way, tested below)."""
    env, full, _ = lightning_full
    if env["STRATEGY"] != "fsdp":
        pytest.skip("the background mode is FSDP2's; under DDP it is refused (test below)")
    stopped = run_example(tmp_path, "lightning_loop.py", "2", env={**env, "ASYNC_MODE": "async"})
    assert all(stopped[s] == full[s] for s in stopped) and sorted(stopped) == list(range(1, 17))
    folder = tmp_path / "outputs" / "lightning" / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt", "last.ckpt"], names
    from dcpkit.integrations.lightning import DcpCheckpointIO

    assert DcpCheckpointIO().load_checkpoint(folder / "last.ckpt")["global_step"] == 16
    resumed = {**env, "ASYNC_MODE": "async_with_pinned_mem"}
    assert_resumed(full, run_example(tmp_path, "lightning_loop.py", env=resumed), 17)


def test_lightning_checkpoint_io_round_trip_and_refusals(tmp_path):
    """In one process: what Lightning hands the plugin comes back equal (integer keys stay
    integers); a damaged file is refused naming it; a parameter outside the prefix is refused."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

    from dcpkit import CheckpointError
    from dcpkit.integrations.lightning import DcpCheckpointIO

    io = DcpCheckpointIO(model_prefix="model.")
    checkpoint = {
        "state_dict": {"model.w": torch.arange(6.0).reshape(2, 3)},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 0.1, "params": [0]}],
            }
        ],
        "epoch": 2,
        "global_step": 16,
        "callbacks": {"ModelCheckpoint{'monitor': 'loss'}": {"best_model_path": "a/b.ckpt"}},
    }
    path = tmp_path / "epoch=2-step=16.ckpt"
    io.save_checkpoint(checkpoint, path)
    back = io.load_checkpoint(path)
    assert back["optimizer_states"][0]["state"][0]["step"].item() == 3.0
    assert back["optimizer_states"][0]["param_groups"][0]["params"] == [0]
    assert torch.equal(back["state_dict"]["model.w"], checkpoint["state_dict"]["model.w"])
    assert back["callbacks"] == checkpoint["callbacks"] and back["global_step"] == 16
    moved = io.load_checkpoint(path, map_location="cpu")
    assert moved["state_dict"]["model.w"].device == torch.device("cpu")
    with pytest.raises(TypeError, match="map_location must be a device"):
        io.load_checkpoint(path, map_location=lambda storage, where: storage)
    data = next(path.glob("*.distcp"))
    blob = bytearray(data.read_bytes())
    blob[0] ^= 0xFF
    data.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=data.name):
        io.load_checkpoint(path)
    with pytest.raises(CheckpointError, match="do not start with model_prefix"):
        io.save_checkpoint({"state_dict": {"head.w": torch.zeros(1)}}, tmp_path / "x.ckpt")
    io.remove_checkpoint(path)
    assert not path.exists()
    weights_only = {"state_dict": checkpoint["state_dict"], "epoch": 2, "global_step": 16}
    io.save_checkpoint(weights_only, tmp_path / "weights.ckpt")  # save_weights_only=True
    back = io.load_checkpoint(tmp_path / "weights.ckpt")
    assert "optimizer_states" not in back and back["epoch"] == 2
    background = AsyncCheckpointIO(io)  # Lightning's own background writer around the plugin
    background.save_checkpoint(checkpoint, tmp_path / "async.ckpt")
    checkpoint["state_dict"]["model.w"].add_(1)  # the state moves on while it is written
    background.teardown()
    back = io.load_checkpoint(tmp_path / "async.ckpt")
    assert torch.equal(back["state_dict"]["model.w"], torch.arange(6.0).reshape(2, 3))
    with pytest.raises(TypeError, match=r"wrap the plugin in Lightning's\s+AsyncCheckpointIO"):
        DcpCheckpointIO(async_mode="async").save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    with pytest.raises(ValueError, match="'later' is not one of disabled, async"):
        DcpCheckpointIO(async_mode="later")


def run_titan(cwd: Path, *args: str, env: dict[str, str] | None = None, ok: bool = True, logs=None):
    cache = {"HF_DATASETS_CACHE": str(cwd / "hf-datasets"), **(env or {})}
    script = ROOT / "tests" / "scripts" / "torchtitan_example.py"  # the example, less a sleep
    return run_example(cwd, script, *args, env=cache, ok=ok, logs=logs)


@pytest.fixture(scope="module")
def titan_full(tmp_path_factory):
    """An uninterrupted run of TorchTitan's Trainer checkpointing through dcpkit."""
    cwd = tmp_path_factory.mktemp("titan-full")
    return run_titan(cwd), cwd / "outputs" / "torchtitan"


def test_torchtitan_trainer_resumes_bitwise_and_interchanges_with_its_own_manager(
    titan_full, tmp_path
):
    full, _ = titan_full
    assert sorted(full) == list(range(1, 9))
    mine, theirs = tmp_path / "dcpkit", tmp_path / "torchtitan"
    mine.mkdir()
    first: list[str] = []
    stopped = run_titan(mine, "4", logs=first)  # a clean stop after step 4's checkpoint
    assert stopped == {s: full[s] for s in range(1, 5)}
    # a fresh job: its first save gathered no plans but the per-dp-rank dataloader entries'
    # (TorchTitan's own checkpointer reads these checkpoints below: "theirs")
    planned = "is planned from the layout every rank shares"
    assert planned in first[0], first[0][-3000:]
    folder = mine / "outputs" / "torchtitan" / "checkpoint"
    assert (folder / "step-4" / "dcpkit.json").is_file()
    shutil.copytree(mine, theirs)
    logs: list[str] = []
    assert_resumed(full, run_titan(mine, logs=logs), 5)  # dcpkit resumes dcpkit's
    # ... and its first save, step 6, planned nothing: the plans of step 4 (the same layout)
    assert "checkpoint: this save takes its plans from step 4" in logs[0], logs[0][-3000:]
    again = tmp_path / "again"
    shutil.copytree(mine, again, ignore=shutil.ignore_patterns("step-8"))
    assert (again / "outputs" / "torchtitan" / "checkpoint" / "step-6" / ".metadata").is_file()
    resumed = run_titan(again, env={"CHECKPOINTER": "torchtitan"})  # TorchTitan's DCP loader
    assert_resumed(full, resumed, 7)
    resumed = run_titan(theirs, env={"CHECKPOINTER": "torchtitan"})  # TorchTitan's, dcpkit's
    assert_resumed(full, resumed, 5)
    own = tmp_path / "own"
    own.mkdir()
    run_titan(own, "4", env={"CHECKPOINTER": "torchtitan"})
    step4 = own / "outputs" / "torchtitan" / "checkpoint" / "step-4"
    assert (step4 / ".metadata").is_file() and not (step4 / "dcpkit.json").exists()
    assert_resumed(full, run_titan(own), 5)  # dcpkit resumes TorchTitan's own checkpoint


def test_torchtitan_killed_mid_save_resumes_from_the_last_published_step(titan_full, tmp_path):
    full, _ = titan_full
    run_titan(tmp_path, env={"DCPKIT_FAILPOINT": "mid_write:6"}, ok=False)
    folder = tmp_path / "outputs" / "torchtitan" / "checkpoint"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-2", "step-4"]
    assert_resumed(full, run_titan(tmp_path), 5)


def test_torchtitan_checkpoint_verifies_and_exports_its_llama(titan_full, tmp_path):
    from safetensors.torch import load_file

    _, out = titan_full
    step = out / "checkpoint" / "step-8"
    proc = cli("verify", str(step))
    assert proc.returncode == 0 and "sizes and checksums of" in proc.stdout, proc.stdout
    hf = tmp_path / "hf"
    proc = cli("to-hf", str(step), str(hf), "--model", "llama3", "--flavor", "debugmodel")
    assert proc.returncode == 0, proc.stderr
    expected = tmp_path / "logits.safetensors"  # TorchTitan's own model, loaded by DCP
    proc = run_python(ROOT / "tests" / "scripts" / "torchtitan_logits.py", str(step), str(expected))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = load_file(expected)
    got = logits_of(hf, want["tokens"])
    assert (got - want["logits"]).abs().max().item() <= 1e-5


def test_torchtitan_dataloader_position_at_another_data_parallel_size_is_refused_naming_the_fix():
    """TorchTitan's own dataloader (a ``ParallelAwareDataloader``) asserts when its position
    comes from another data-parallel size, and on a rank the checkpoint has no position for
    starts over with a warning; dcpkit's manager refuses both while loading, before training,
    saying to exclude ``dataloader``."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from dcpkit import CheckpointError
    from dcpkit.integrations.torchtitan import _Dataloader

    data = torch.utils.data.TensorDataset(torch.arange(16.0))
    saved = [
        ParallelAwareDataloader(data, dp_rank=r, dp_world_size=2, batch_size=2) for r in (0, 1)
    ]
    for loader in saved:
        next(iter(loader))
    states = [_Dataloader(loader).state_dict() for loader in saved]
    assert states[0]["world_size"] == 2 and "dp_rank_0" in states[0]
    for now, rank in ((1, 0), (4, 3)):  # 2 -> 1: TorchTitan asserts; 2 -> 4: rank 3 starts over
        loader = _Dataloader(ParallelAwareDataloader(data, dp_rank=rank, dp_world_size=now))
        with pytest.raises(CheckpointError, match=r'Add "dataloader" to checkpoint\.exclude_from'):
            loader.load_state_dict(states[min(rank, 1)])
    same = _Dataloader(ParallelAwareDataloader(data, dp_rank=1, dp_world_size=2, batch_size=2))
    same.load_state_dict(states[1])  # the same size: the position goes on
    assert next(iter(same.loader))[0].tolist() == [2.0, 3.0]  # its 2nd batch, not its 1st


def test_torchtitan_config_holds_every_option_of_both_with_their_defaults():
    """TorchTitan's options, and dcpkit's under the same names and defaults as
    `CheckpointConfig`: a TorchTitan user reads one set of option names."""
    import dataclasses

    from torchtitan.components.checkpointer import BaseCheckpointManager

    from dcpkit import CheckpointConfig
    from dcpkit.integrations.torchtitan import DcpkitCheckpointManager, checkpoint_config

    def defaults(cls):
        out = {}
        for f in dataclasses.fields(cls):
            if f.init and not f.name.startswith("_"):
                has = f.default is not dataclasses.MISSING
                out[f.name] = f.default if has else f.default_factory()
        return out

    ours, base = defaults(DcpkitCheckpointManager.Config), defaults(BaseCheckpointManager.Config)
    dcpkit = defaults(CheckpointConfig)
    assert set(base) <= set(ours)
    assert {k: v for k, v in ours.items() if k in dcpkit} == {
        k: v for k, v in dcpkit.items() if k in ours
    }
    assert set(dcpkit) - set(ours) == set(), set(dcpkit) - set(ours)
    config = DcpkitCheckpointManager.Config(enable=True, interval=7, verify_on_load=False)
    converted = checkpoint_config(config)
    assert (converted.interval, converted.verify_on_load) == (7, False)


def titan_options(**options) -> dict[str, str]:
    import json

    return {"CHECKPOINT_OPTIONS": json.dumps(options)}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP step or of a Hugging Face folder, by name."""
    from safetensors.torch import load_file

    from dcpkit.formats.dcp import DCPCheckpoint

    if (folder / ".metadata").is_file():
        with DCPCheckpoint(folder) as src:
            return {k: src.read(k) for k in src.tensors}
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_torchtitan_starts_from_a_hugging_face_folder_and_ends_with_one(titan_full, tmp_path):
    """TorchTitan's own Trainer with ``initial_load_in_hf`` and ``last_save_in_hf`` through
    dcpkit's manager, converting with the state-dict adapter TorchTitan gives it: it starts
    from a ``save_pretrained`` folder exactly as from the same weights imported by ``dcpkit
    from-hf`` and as TorchTitan's own manager does; its last save loads with
    ``from_pretrained`` (logits of TorchTitan's model) and holds the tensors TorchTitan's own
    manager writes on the same run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, out = titan_full
    shape = tmp_path / "shape"  # the debug model's config.json, from an export of a run
    proc = cli("to-hf", str(out / "checkpoint" / "step-8"), str(shape), "--model", "llama3",
               "--flavor", "debugmodel")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    torch.manual_seed(1)
    start = tmp_path / "start"
    LlamaForCausalLM(LlamaConfig.from_pretrained(shape)).save_pretrained(start)
    assets = tmp_path / "assets"  # the model's Hugging Face assets: tokenizer and config.json
    shutil.copytree(out / "assets", assets)
    shutil.copy(start / "config.json", assets / "config.json")
    hf_in = {"initial_load_path": str(start), "initial_load_in_hf": True}
    hf_both = {**hf_in, "last_save_in_hf": True, "last_save_model_only": True}
    runs = {}
    for name, options, checkpointer in (
        ("dcpkit", hf_both, "dcpkit"),
        ("torchtitan", hf_both, "torchtitan"),  # TorchTitan's own manager, the same options
        ("family", {**hf_in, "hf_model": "llama3:debugmodel"}, "dcpkit"),  # dcpkit's converter
    ):
        cwd = tmp_path / name
        cwd.mkdir()
        env = {**titan_options(**options), "HF_ASSETS": str(assets), "CHECKPOINTER": checkpointer}
        runs[name] = run_titan(cwd, env=env), cwd / "outputs" / "torchtitan" / "checkpoint"
    imported = tmp_path / "imported"
    assert cli("from-hf", str(start), str(imported)).returncode == 0
    cwd = tmp_path / "imported-run"
    cwd.mkdir()
    env = {**titan_options(initial_load_path=str(imported)), "HF_ASSETS": str(assets)}
    runs["imported"] = run_titan(cwd, env=env), cwd / "outputs" / "torchtitan" / "checkpoint"
    losses = {name: run[0] for name, run in runs.items()}
    assert losses["dcpkit"][1] == losses["imported"][1]  # the first loss: the same weights
    assert losses["dcpkit"] == losses["imported"] == losses["torchtitan"] == losses["family"]
    assert losses["dcpkit"][1] != titan_full[0][1]  # not the run's own initial weights
    export = runs["dcpkit"][1] / "step-8"
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
    ours, theirs = read_tensors(export), read_tensors(runs["torchtitan"][1] / "step-8")
    assert sorted(ours) == sorted(theirs) and len(ours) == 57
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    expected = tmp_path / "logits.safetensors"  # TorchTitan's model at step 8 of the same run
    proc = run_python(
        ROOT / "tests" / "scripts" / "torchtitan_logits.py",
        str(runs["imported"][1] / "step-8"),
        str(expected),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    want = load_file(expected)
    assert (logits_of(export, want["tokens"]) - want["logits"]).abs().max().item() <= 1e-5


def test_torchtitan_checkpoint_options_beside_its_own_manager(titan_full, tmp_path):
    """Each of TorchTitan's ``[checkpoint]`` options driven in TorchTitan's own Trainer,
    through dcpkit's manager and TorchTitan's own on the same run: ``keep_latest_k``,
    ``last_save_model_only`` with ``export_dtype``, both async modes (TorchTitan's own
    ``async_with_pinned_mem`` needs CUDA: dcpkit's runs it on the CPU), ``load_step`` and
    ``exclude_from_loading``."""
    full, out = titan_full
    kept = {"keep_latest_k": 2, "last_save_model_only": True, "export_dtype": "bfloat16"}
    folders = {}
    for name, mode, checkpointer in (
        ("dcpkit", "async_with_pinned_mem", "dcpkit"),
        ("torchtitan", "async", "torchtitan"),
    ):
        cwd = tmp_path / f"kept-{name}"
        cwd.mkdir()
        env = {**titan_options(**kept, async_mode=mode), "CHECKPOINTER": checkpointer}
        assert run_titan(cwd, env=env) == full  # saving in the background changes no loss
        folders[name] = cwd / "outputs" / "torchtitan" / "checkpoint"
    steps = {n: sorted(p.name for p in f.glob("step-*")) for n, f in folders.items()}
    assert steps["dcpkit"] == ["step-6", "step-8"], steps  # keep_latest_k 2, nothing more
    assert {"step-6", "step-8"} <= set(steps["torchtitan"]), steps
    ours, theirs = (read_tensors(f / "step-8") for f in folders.values())
    trained = read_tensors(out / "checkpoint" / "step-8")  # the full run's step 8, float32
    assert sorted(ours) == sorted(theirs) and len(ours) == 57  # the model only
    assert {t.dtype for t in ours.values()} == {torch.bfloat16}
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    assert [k for k in ours if not torch.equal(ours[k], trained[k].bfloat16())] == []
    resumed = {}
    for name, options, checkpointer in (
        ("load_step", {"load_step": 4}, "dcpkit"),
        ("excluded", {"load_step": 4, "exclude_from_loading": ["dataloader"]}, "dcpkit"),
        ("excluded-own", {"load_step": 4, "exclude_from_loading": ["dataloader"]}, "torchtitan"),
    ):
        cwd = tmp_path / name
        shutil.copytree(out.parent.parent, cwd, ignore=shutil.ignore_patterns("hf-datasets"))
        env = {**titan_options(**options, async_mode="async"), "CHECKPOINTER": checkpointer}
        resumed[name] = run_titan(cwd, env=env)
    assert_resumed(full, resumed["load_step"], 5)  # step 4 of 8, not the latest
    assert sorted(resumed["excluded"]) == [5, 6, 7, 8]
    assert resumed["excluded"] == resumed["excluded-own"]  # as TorchTitan's own manager does it
    assert resumed["excluded"][5] != full[5]  # the data order started over: the loss differs


def test_torchtitan_hugging_face_options_without_an_adapter_are_refused_naming_the_fix():
    from dcpkit import ConfigError
    from dcpkit.convert.hf_model import HFModel
    from dcpkit.integrations.torchtitan import DcpkitCheckpointManager, hf_codec

    config = DcpkitCheckpointManager.Config(enable=True, last_save_in_hf=True)
    with pytest.raises(ConfigError, match=r'no state-dict adapter .* checkpoint\.hf_model = "F'):
        hf_codec(config, None)
    config.hf_model = "llama3"
    with pytest.raises(ConfigError, match='give a family and a flavor, as "llama3:8B"'):
        hf_codec(config, None)
    config.hf_model = "llama3:debugmodel"
    assert isinstance(hf_codec(config, None), HFModel)
