"""The transformers ``Trainer`` checkpointing through ``DcpkitTrainerMixin``: its own training
loop on 2 processes (DDP, gloo), a tiny Llama with attention dropout, a shuffled dataset and 2
micro-batches per step (``examples/transformers_trainer.py``); every later micro-batch loss of a
resumed run bitwise equal to an uninterrupted run's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_base_linked, cli, run_ranks


def trainer_run(out, *args: str, env: dict[str, str] | None = None, ok: bool = True, cwd=None):
    """Each rank's loss of each micro-batch, by (rank, step, micro-batch)."""
    example = ROOT / "examples" / "transformers_trainer.py"
    proc = run_ranks(2, example, str(out), *args, env=env, cwd=cwd)
    if ok:  # each rank's error first: the launcher's own report follows it at length
        errors = [x for x in proc.stderr.splitlines() if re.search(r"(Error|Exception)\b", x)]
        assert proc.returncode == 0, "\n".join(errors[:20]) + proc.stderr[-3000:]
    else:
        assert proc.returncode != 0, "the run was to be killed"
    losses = {}
    for line in proc.stdout.splitlines():
        if line.startswith("loss "):
            _, rank, step, micro, value = line.split()
            losses[(int(rank), int(step), int(micro))] = value
    return losses, proc.stdout + proc.stderr


def steps_of(folder: Path) -> list[str]:
    return sorted((p.name for p in folder.glob("step-*")), key=lambda n: int(n[5:]))


@pytest.fixture(scope="module")
def trainer_full(tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer") / "full"
    losses, _ = trainer_run(out)
    assert len(losses) == 2 * 14 * 2  # 2 ranks, 14 steps, 2 micro-batches
    return losses, out


@pytest.mark.dist
def test_trainer_resumes_bitwise_after_a_stop_mid_epoch_and_a_kill_mid_save(trainer_full, tmp_path):
    full, _ = trainer_full
    # a clean stop after step 9, in the 2nd epoch (6 steps an epoch), keeping 2 steps
    out, limit = tmp_path / "stopped", {"SAVE_TOTAL_LIMIT": "2"}
    first, _ = trainer_run(out, "9", env=limit)
    assert {s for _, s, _ in first} == set(range(1, 10))
    assert steps_of(out / "checkpoint") == ["step-6", "step-9"]
    # links where the Trainer's conventions look: only to the steps retention kept
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-9"]
    assert (out / "checkpoint-9").resolve() == (out / "checkpoint" / "step-9").resolve()
    refused = trainer_run(out, env=limit, ok=False)[1]  # a fresh start on the run's folder
    assert "resume_from_checkpoint=True" in refused and "get_last_checkpoint" in refused
    assert steps_of(out / "checkpoint") == ["step-6", "step-9"]  # nothing trained or deleted
    # resumed as transformers' example scripts resume: get_last_checkpoint(output_dir)
    resumed, log = trainer_run(out, "--last-checkpoint", env=limit)
    assert "loaded" in log and "step-9" in log
    assert {s for _, s, _ in resumed} == set(range(10, 15))
    assert [k for k, v in {**first, **resumed}.items() if full[k] != v] == []
    assert steps_of(out / "checkpoint") == ["step-12", "step-14"]  # save_total_limit = 2
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-14"]
    listed = cli("list", str(out))  # the Trainer's output_dir: its checkpoint folder's steps
    assert listed.returncode == 0 and "step-12" in listed.stdout and "step-14" in listed.stdout
    # SIGKILL in the middle of step 12's background write (async_with_pinned_mem)
    out, pinned = tmp_path / "killed", {"ASYNC_MODE": "async_with_pinned_mem"}
    trainer_run(out, env={**pinned, "DCPKIT_FAILPOINT": "mid_write:12"}, ok=False)
    assert steps_of(out / "checkpoint") == ["step-3", "step-6", "step-9"]
    resumed, log = trainer_run(out, "--resume", env=pinned)
    assert "step-9" in log and "step-12 " not in log.split("loaded")[0]
    assert {s for _, s, _ in resumed} == set(range(10, 15))  # never from the killed save
    assert [k for k, v in resumed.items() if full[k] != v] == []
    assert cli("verify", str(out / "checkpoint" / "step-14")).returncode == 0


@pytest.mark.dist
def test_a_run_saved_by_the_trainer_itself_resumes_through_the_mixin(trainer_full, tmp_path):
    """Earlier checkpoints that are the Trainer's own ``checkpoint-N`` folders: the mixin's
    ``resume_from_checkpoint=True`` (no dcpkit step yet) and a ``checkpoint-N`` path resume
    from them with the Trainer's own load; dcpkit saves from then on, beside them."""
    full, _ = trainer_full
    out = tmp_path / "own"
    first, _ = trainer_run(out, "9", env={"TRAINER": "own"})
    assert (out / "checkpoint-9").is_dir() and not (out / "checkpoint-9").is_symlink()
    resumed, log = trainer_run(out, "--resume")
    assert "resuming from the Trainer's own" in log and "checkpoint-9" in log
    assert [k for k, v in {**first, **resumed}.items() if full[k] != v] == []
    assert steps_of(out / "checkpoint") == ["step-12", "step-14"]
    assert (out / "checkpoint-9").is_dir() and (out / "checkpoint-14").is_symlink()


@pytest.mark.dist
def test_the_best_checkpoint_survives_save_total_limit_and_loads_at_the_end(tmp_path):
    """``metric_for_best_model`` with ``save_total_limit=2`` and ``load_best_model_at_end``:
    retention keeps the best step beside the newest, as the Trainer does, and the run ends
    with the best step's weights. (The metric is the eval loss with greater_is_better, so that
    the best step is the first one evaluated, step 3: an old step retention would delete.)"""
    from dcpkit.formats.dcp import DCPCheckpoint

    out = tmp_path / "best"
    _, log = trainer_run(out, env={"EVAL": "1", "SAVE_TOTAL_LIMIT": "2"})
    assert steps_of(out / "checkpoint") == ["step-3", "step-14"], log[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-14", "checkpoint-3"]
    final = torch.load(out / "final-model.pt", weights_only=True)
    with DCPCheckpoint(out / "checkpoint" / "step-3") as best:
        assert final and all(torch.equal(value, best.read(key)) for key, value in final.items())
    with DCPCheckpoint(out / "checkpoint" / "step-14") as last:  # not the run's last weights
        assert not all(torch.equal(value, last.read(key)) for key, value in final.items())


SFT = {"TRAINER": "sft"}


@pytest.fixture(scope="module")
def sft_full(tmp_path_factory):
    """An uninterrupted run of TRL's ``SFTTrainer`` with the mixin: each micro-batch's loss."""
    full, _ = trainer_run(tmp_path_factory.mktemp("sft") / "full", env=SFT)
    assert len(full) == 2 * 14 * 2
    return full


@pytest.mark.dist
def test_trl_sft_trainer_resumes_bitwise(sft_full, tmp_path):
    """TRL's ``SFTTrainer`` (built on ``Trainer``) with the mixin: stopped after step 9, and
    killed in the middle of step 12's save; each resumed, every micro-batch loss equal to an
    uninterrupted run's."""
    sft, full = SFT, sft_full
    out = tmp_path / "stopped"
    first, _ = trainer_run(out, "9", env=sft)
    resumed, log = trainer_run(out, "--resume", env=sft)
    assert "step-9" in log and {s for _, s, _ in resumed} == set(range(10, 15))
    assert [k for k, v in {**first, **resumed}.items() if full[k] != v] == []
    # `to-hf STEP OUT` alone: the model, and the run's tokenizer (saved once into output_dir)
    hf = tmp_path / "hf"
    done = cli("to-hf", str(out / "checkpoint" / "step-14"), str(hf))
    assert done.returncode == 0 and f"tokenizer: {out}'s" in done.stdout, done
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf)  # the run's: t0..t127, eos t1
    assert tokenizer("t5")["input_ids"][0] == 5 and tokenizer.eos_token == "t1"
    assert AutoModelForCausalLM.from_pretrained(hf).config.eos_token_id == 1  # the tokenizer's
    out = tmp_path / "killed"  # SIGKILL in the middle of step 12's write
    trainer_run(out, env={**sft, "DCPKIT_FAILPOINT": "mid_write:12"}, ok=False)
    assert steps_of(out / "checkpoint") == ["step-3", "step-6", "step-9"]
    resumed, _ = trainer_run(out, "--resume", env=sft)
    assert [k for k, v in resumed.items() if full[k] != v] == [] and len(resumed) == 20


# The oldest and the newest releases the mixin supports (``TESTED``, ``TESTED_TRL``); the rest of
# the suite runs the ones constraints.txt pins (transformers 5.24.0, TRL 1.16.0).
RELEASES = {
    "oldest": ("transformers==5.23.0", "trl==1.14.2"),
    "newest": ("transformers==5.25.0", "trl==1.16.0"),
}
REPLACED = (
    "train", "_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
    "_load_rng_state", "_load_scaler", "_load_best_model",
)  # fmt: skip


def release_python(which: str) -> Path:
    """The Python of a virtual environment with the release's transformers and TRL installed
    over this environment's packages (seen through a ``.pth`` line, so that only what the
    release needs otherwise is downloaded; torch stays this one's), made once and kept in this
    environment's folder (``.venv/releases``)."""
    import fcntl
    import shutil
    import subprocess
    import sys

    pins = RELEASES[which]
    venv = Path(sys.prefix) / "releases" / "-".join(p.replace("==", "-") for p in pins)
    python = venv / "bin" / "python"
    venv.parent.mkdir(exist_ok=True)
    with open(venv.parent / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / ".installed").is_file():
            return python
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        purelib = subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
        import sysconfig

        ours = sysconfig.get_paths()["purelib"]  # its .pth files too (dcpkit's editable install)
        Path(purelib, "_suite_env.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
        torch_pin = venv / "torch.txt"
        torch_pin.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
        cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet"]
        proc = subprocess.run(
            [*cmd, "-c", str(torch_pin), *pins], capture_output=True, text=True, timeout=600
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        (venv / ".installed").write_text(" ".join(pins) + "\n")
    return python


def _replaced_methods(trainer_py: Path) -> dict[str, str]:
    """The source of each ``Trainer`` method the mixin replaces, in a release's trainer.py."""
    import ast

    source = trainer_py.read_text()
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    found = {f.name: ast.get_source_segment(source, f) for f in cls.body if hasattr(f, "name")}
    return {name: found.get(name, "") for name in REPLACED}


@pytest.mark.dist
@pytest.mark.parametrize("which", sorted(RELEASES))
def test_the_mixin_on_the_oldest_and_newest_releases_it_supports(sft_full, tmp_path, which):
    """TRL's ``SFTTrainer`` with the mixin on the oldest (transformers 5.23, TRL 1.14) and the
    newest (5.25, 1.16) releases the mixin accepts, each in an environment of its own: their
    ``Trainer`` methods the mixin replaces are, to the character, those of the release the rest
    of the suite runs; stopped after step 9 and resumed, every micro-batch loss equal to an
    uninterrupted run's: on the newest, the suite's own on 5.24 (their losses are the same), on
    the oldest, its own (TRL 1.14's losses differ from 1.16's). The runs go to a rank pool of
    the release environment's Python, as the suite's runs go to the suite's."""
    import subprocess

    import transformers

    from conftest import torchrun_env
    from ranks import RankPool

    python = release_python(which)
    shown = subprocess.run(
        [python, "-c", "import transformers, trl; print(transformers.__file__, "
         "transformers.__version__, trl.__version__)"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert shown[1:] == [p.split("==")[1] for p in RELEASES[which]], shown
    theirs = _replaced_methods(Path(shown[0]).parent / "trainer.py")
    ours = _replaced_methods(Path(transformers.__file__).parent / "trainer.py")
    assert all(ours.values()) and theirs == ours, [n for n in REPLACED if theirs[n] != ours[n]]
    example = ROOT / "examples" / "transformers_trainer.py"
    runs = {"full": sft_full} if which == "newest" else {}
    pool = RankPool(torchrun_env(), tmp_path / "ranks", python=str(python))  # torch once a rank
    try:
        for name, folder, args in (("full", "full", []), ("stopped", "run", ["9"]),
                                   ("resumed", "run", ["--resume"])):  # fmt: skip
            if name in runs:
                continue
            proc = pool.run(2, "script", str(example), [str(tmp_path / folder), *args],
                            torchrun_env(SFT), timeout=600)  # fmt: skip
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
            found = re.findall(r"^loss (\d) (\d+) (\d) (\S+)$", proc.stdout, re.M)
            runs[name] = {(int(r), int(s), int(m)): v for r, s, m, v in found}
    finally:
        pool.close()
    full, first, resumed = runs["full"], runs["stopped"], runs["resumed"]
    assert len(full) == 2 * 14 * 2 and {s for _, s, _ in resumed} == set(range(10, 15))
    assert [k for k, v in {**first, **resumed}.items() if full[k] != v] == []


@pytest.mark.dist
def test_a_lora_fine_tune_under_the_trainer_resumes_bitwise(tmp_path):
    """PEFT LoRA adapters of the model under the Trainer: every weight decays, so the Trainer's
    no-decay parameter group is empty (torch's flattened optimizer state has no place for its
    settings, and a resume used to fail). Stopped after step 9 and resumed: every later
    micro-batch loss equal to an uninterrupted run's."""
    out, keys = _lora_stopped_and_resumed(tmp_path, {"LORA": "1"})
    assert "optimizer.empty_param_groups.0.1.weight_decay" in keys  # the empty no-decay group
    _exports_of_a_lora_step(out / "checkpoint" / "step-14", tmp_path)


@pytest.mark.dist
def test_a_lora_fine_tune_under_trl_resumes_bitwise(tmp_path):
    """TRL's ``SFTTrainer`` given ``peft_config`` (it wraps the model itself, as TRL's users
    do) with the mixin: the adapters saved, stopped after step 9 and resumed, every later
    micro-batch loss equal to an uninterrupted run's."""
    _lora_stopped_and_resumed(tmp_path, {**SFT, "LORA": "1"})


def _lora_stopped_and_resumed(tmp_path: Path, lora: dict[str, str]) -> tuple[Path, list[str]]:
    """The example with ``lora``'s settings run through (its frozen base written once, each
    rank's file of it linked by every later step), and stopped after step 9 (its step 9
    holding the adapters) then resumed: every micro-batch loss the uninterrupted run's. Returns
    the stopped run's folder and step 9's keys."""
    from dcpkit.formats.dcp import DCPCheckpoint

    full, _ = trainer_run(tmp_path / "full", env=lora)
    assert len(full) == 2 * 14 * 2
    assert_base_linked(tmp_path / "full" / "checkpoint", 2)
    out = tmp_path / "stopped"
    first, _ = trainer_run(out, "9", env=lora)
    with DCPCheckpoint(out / "checkpoint" / "step-9") as step:
        keys = list(step.metadata.state_dict_metadata)
    assert any("lora_A" in k for k in keys), keys[:10]
    resumed, log = trainer_run(out, "--resume", env=lora)
    assert "step-9" in log and {s for _, s, _ in resumed} == set(range(10, 15))
    assert [k for k, v in {**first, **resumed}.items() if full[k] != v] == []
    return out, keys


def _exports_of_a_lora_step(step: Path, tmp_path: Path) -> None:
    """`to-hf` of the step with no arguments: the adapter folder, which PEFT loads onto the base;
    `--merge`: the merged model, which transformers loads alone. Both give the trained model's
    logits (the base the example builds, seed 0, with the step's weights) within 1e-5."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from dcpkit.formats.dcp import DCPCheckpoint

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    done = cli("to-hf", str(step), str(adapter))
    assert done.returncode == 0, done.stderr
    assert "a PEFT model: from the checkpoint's manifest" in done.stdout, done.stdout
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in adapter.iterdir()
    }
    done = cli("to-hf", str(step), str(merged), "--merge")
    assert done.returncode == 0, done.stderr
    config = LlamaConfig.from_pretrained(merged)

    def base() -> LlamaForCausalLM:  # as the example builds it
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.config._attn_implementation = "eager"
        return model

    trained = get_peft_model(base(), LoraConfig.from_pretrained(adapter))
    with DCPCheckpoint(step) as src:
        weights = {k: src.read(k) for k in src.tensors if src.is_model_key(k)}
    assert set(weights) == set(trained.state_dict())
    frozen = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert torch.equal(weights[frozen], trained.state_dict()[frozen])  # the base is the example's
    trained.load_state_dict(weights)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = trained.eval()(input_ids=tokens).logits
        peft = PeftModel.from_pretrained(base(), adapter).eval()
        whole = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
        for model in (peft, whole):
            assert (model(input_ids=tokens).logits - want).abs().max().item() <= 1e-5
    assert not any("lora" in k for k in whole.state_dict())


@pytest.mark.dist
def test_a_trainer_writes_to_and_resumes_from_s3(trainer_full, seaweedfs, monkeypatch, tmp_path):
    """``output_dir`` an ``s3://`` URL (SeaweedFS): the steps go to the bucket, nothing is
    written locally, and a resume from the bucket goes on bitwise."""
    from conftest import BUCKET, use_endpoint

    full, _ = trainer_full
    use_endpoint(monkeypatch, seaweedfs)
    url = f"s3://{BUCKET}/trainer-run"
    first, _ = trainer_run(url, "6", cwd=tmp_path)
    proc = cli("list", f"{url}/checkpoint")
    assert proc.returncode == 0 and "step-6" in proc.stdout, proc.stdout + proc.stderr
    resumed, log = trainer_run(url, "--resume", cwd=tmp_path)
    assert "loaded s3://" in log, log[-3000:]
    assert {s for _, s, _ in resumed} == set(range(7, 15))
    assert [k for k, v in {**first, **resumed}.items() if full[k] != v] == []
    assert list(tmp_path.iterdir()) == []  # nothing beside the bucket


@pytest.mark.dist
def test_a_trainer_checkpoint_exports_to_a_folder_from_pretrained_loads(trainer_full, tmp_path):
    from transformers import AutoModelForCausalLM

    from dcpkit.formats.dcp import DCPCheckpoint

    _, out = trainer_full
    step = out / "checkpoint" / "step-14"
    proc = cli("to-hf", str(step), str(tmp_path / "hf"))  # the model recorded: no flavor
    assert proc.returncode == 0, proc.stderr
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    with DCPCheckpoint(step) as src:
        saved = {k: src.read(k) for k in src.tensors if src.is_model_key(k)}
    loaded = model.state_dict()
    assert set(saved) <= set(loaded)
    assert [k for k in saved if not torch.equal(saved[k], loaded[k])] == []


def test_the_trainer_mixin_refuses_an_untested_transformers_and_options_it_cannot_keep(
    tmp_path, monkeypatch
):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from dcpkit import ConfigError
    from dcpkit.integrations import transformers as integration
    from dcpkit.integrations.transformers import TESTED, DcpkitTrainerMixin, check_version

    class MyTrainer(DcpkitTrainerMixin, Trainer):
        pass

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                                         num_hidden_layers=1, num_attention_heads=2))  # fmt: skip

    def build(**options):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **options)
        return MyTrainer(model=model, args=args, eval_dataset=[{"input_ids": torch.zeros(4)}])

    assert build().dcpkit_config.keep_latest_k == 0
    from dcpkit import CheckpointError

    with pytest.raises(CheckpointError, match="is not a step of this run's folder"):
        build().train(resume_from_checkpoint=str(tmp_path / "another-run" / "step-3"))
    assert build(save_total_limit=3).dcpkit_config.keep_latest_k == 3
    with pytest.raises(ConfigError, match="save_total_limit = 1 would delete"):
        build(save_total_limit=1)
    with pytest.raises(CheckpointError, match=r"checkpoint-N of output_dir|not a checkpoint of"):
        build().train(resume_from_checkpoint=str(tmp_path / "another-run" / "checkpoint-3"))
    check_version(".".join(map(str, TESTED[0])) + ".0")
    refused = r"tested with trl 1\.14 to 1\.16\.x; this is trl 0\.9\.6"
    with pytest.raises(ConfigError, match=refused):
        check_version("0.9.6", "trl")
    check_version(".".join(map(str, TESTED[1])) + ".9")
    for version in ("4.57.1", "5.22.2", "5.26.0", "5.99.0", "dev"):
        monkeypatch.setattr(integration, "installed_version", lambda v=version: v)
        with pytest.raises(ConfigError, match=rf"tested with transformers .*this is .*{version}"):
            build()


@pytest.mark.parametrize(
    "saved, rule",
    [
        ([1, 2], "a JSON list, not the object of a TrainerState"),
        ({"global_step": "x"}, "global_step = 'x', where a TrainerState holds int"),
        ({"global_step": 3, "mood": "x"}, "fields this release's TrainerState does not have: mood"),
        (b"{", "not a JSON document"),
    ],
    ids=["a-list", "a-string-step", "an-unknown-field", "no-json"],
)
def test_a_saved_trainer_state_the_trainer_cannot_read_is_refused_naming_key_and_rule(
    tmp_path, saved, rule
):
    """A step whose saved ``TrainerState`` is not one (written by a broken or hostile writer
    through the public API): the resume stops before the Trainer reads it, naming the step,
    the key and what is wrong, instead of a raw error inside the Trainer."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager
    from dcpkit.integrations.transformers import DcpkitTrainerMixin

    class Saved:
        def state_dict(self):
            raw = saved if isinstance(saved, bytes) else json.dumps(saved).encode()
            return {"json": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}

        def load_state_dict(self, state):
            pass

    config = CheckpointConfig(enable=True, interval=1)
    layer = torch.nn.Linear(2, 2)
    with CheckpointManager(
        config, tmp_path, layer, per_rank_states={"trainer_state": Saved()}
    ) as m:
        m.save(3)

    class MyTrainer(DcpkitTrainerMixin, Trainer):
        pass

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
                                         num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=4)
    trainer = MyTrainer(model=model, args=args, train_dataset=[{"input_ids": torch.zeros(4)}])
    with pytest.raises(CheckpointError) as e:
        trainer.train(resume_from_checkpoint=True)
    said = "step-3: its trainer_state.rank_0.json cannot be the Trainer's TrainerState: "
    assert said in str(e.value), e.value
    assert rule in str(e.value), e.value
