"""CheckpointManager in one process: what it saves, restores, refuses, and leaves on disk."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from conftest import ROOT, Counter, free_port, read_manifest, torchrun_env
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager, ConfigError
from dcpkit.models import build_model
from dcpkit.storage import open_store

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _setup(seed=0):
    torch.manual_seed(seed)
    model = build_model("llama3", "debugmodel", max_seq_len=32, n_layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched, Counter()


def _train(model, opt, sched, counter, steps, mgr=None):
    tokens = torch.randint(0, 2048, (2, 17), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.step += 1
        if mgr is not None:
            mgr.save(counter.step)


def _manager(tmp_path, model, opt, sched, counter, **cfg):
    config = CheckpointConfig(enable=True, **cfg)
    return CheckpointManager(config, tmp_path, model, opt, sched, states={"train_state": counter})


def test_round_trip_restores_everything(tmp_path):
    model, opt, sched, counter = _setup()
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=3)
    _train(model, opt, sched, counter, 3, mgr)
    expected_rand = (random.random(), np.random.rand(), torch.rand(3))
    mgr.close()  # one manager saves into a folder at a time, in a process too

    model2, opt2, sched2, counter2 = _setup(seed=1)
    mgr2 = _manager(tmp_path, model2, opt2, sched2, counter2, interval=3)
    assert mgr2.load() == 3
    assert counter2.step == 3
    assert sched2.last_epoch == 3 and sched2.get_last_lr() == sched.get_last_lr()
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    for a, b in zip(opt.state_dict()["state"].values(), opt2.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) and torch.equal(a["step"], b["step"])
    # The RNG streams continue exactly where the save left them.
    assert (random.random(), np.random.rand()) == expected_rand[:2]
    assert torch.equal(torch.rand(3), expected_rand[2])
    # Both continue identically.
    _train(model, opt, sched, counter, 2)
    _train(model2, opt2, sched2, counter2, 2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_a_replaced_parameter_is_collected_under_its_name(tmp_path):
    """The state-dict set-up is reused between saves, but a parameter replaced (here in the
    model and the optimizer, as a user re-initializing a layer does) is saved, with its
    optimizer state, under its own name."""
    model, opt, sched, counter = _setup()
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=1)
    _train(model, opt, sched, counter, 1, mgr)
    old = model.norm.weight
    model.norm.weight = torch.nn.Parameter(torch.full_like(old, 3.0))
    group = opt.param_groups[0]["params"]
    group[next(i for i, p in enumerate(group) if p is old)] = model.norm.weight
    opt.state[model.norm.weight] = opt.state.pop(old)
    _train(model, opt, sched, counter, 1, mgr)
    state = mgr.collect()
    new = model.norm.weight
    assert torch.equal(state["norm.weight"], new.detach())
    assert torch.equal(state["optimizer"]["state.norm.weight.exp_avg"], opt.state[new]["exp_avg"])


def test_a_large_share_is_written_as_a_file_per_thread(tmp_path, monkeypatch):
    """Past ``FILE_SHARE`` bytes a rank writes a file per thread; the step verifies and loads
    back bitwise, as a single-file one does."""
    import dcpkit.storage.local as local
    from dcpkit.dist import io_threads

    monkeypatch.setattr(local, "FILE_SHARE", 64 << 10)
    model, opt, sched, counter = _setup()
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=1)
    _train(model, opt, sched, counter, 1, mgr)
    step = tmp_path / "checkpoint" / "step-1"
    files = sorted(p.name for p in step.glob("*.distcp"))
    assert files == [f"__0_{i}.distcp" for i in range(io_threads())], files
    assert mgr.verify(step) == []
    mgr.close()
    model2, opt2, sched2, counter2 = _setup(seed=1)
    assert _manager(tmp_path, model2, opt2, sched2, counter2, interval=1).load() == 1
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"])


def test_records_are_written_without_crc32_and_dcp_reads_them(tmp_path, monkeypatch):
    """A save's torch.save records carry no CRC-32 (the manifest's checksums cover them), those
    of the files DCP's writer threads write too (torch 2.13 keeps the switch per thread), torch's
    setting is as it was after the save, and DCP's own reader loads the step."""
    import io
    import zipfile

    import torch.distributed.checkpoint as dcp

    import dcpkit.storage.local as local

    monkeypatch.setattr(local, "FILE_SHARE", 64 << 10)  # a file per writer thread
    monkeypatch.setattr(local, "io_threads", lambda: 3)
    model, opt, sched, counter = _setup()
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=1)
    _train(model, opt, sched, counter, 1, mgr)
    assert torch.serialization.get_crc32_options()
    step = tmp_path / "checkpoint" / "step-1"
    assert len(list(step.glob("*.distcp"))) == 3
    reader = FileSystemReader(str(step))
    crcs = set()
    for info in reader.read_metadata().storage_data.values():
        with open(step / info.relative_path, "rb") as f:
            f.seek(info.offset)
            archive = zipfile.ZipFile(io.BytesIO(f.read(info.length)))
        crcs |= {i.CRC for i in archive.infolist() if i.file_size}
    assert crcs == {0}
    want = model.state_dict()
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=reader, no_dist=True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert mgr.verify(step) == []


def test_layout_is_torchtitans(tmp_path):
    model, opt, sched, counter = _setup()
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=1)
    _train(model, opt, sched, counter, 1, mgr)
    keys = set(
        FileSystemReader(str(tmp_path / "checkpoint" / "step-1"))
        .read_metadata()
        .state_dict_metadata
    )
    assert "tok_embeddings.weight" in keys and "layers.1.feed_forward.w2.weight" in keys
    assert "optimizer.state.tok_embeddings.weight.exp_avg" in keys
    assert "train_state.step" in keys and "rng.rank_0.torch" in keys  # RNG as tensors
    assert any(k.startswith("lr_scheduler.") for k in keys)
    assert not any(k.startswith("model.") for k in keys)


def test_exclude_from_loading(tmp_path):
    model, opt, sched, counter = _setup()
    _train(
        model, opt, sched, counter, 2, _manager(tmp_path, model, opt, sched, counter, interval=2)
    )
    model2, opt2, sched2, counter2 = _setup(seed=1)
    mgr2 = _manager(
        tmp_path, model2, opt2, sched2, counter2, exclude_from_loading=["optimizer", "train_state"]
    )
    mgr2.load()
    assert counter2.step == 0 and opt2.state_dict()["state"] == {}
    assert torch.equal(model.output.weight, model2.output.weight)
    with pytest.raises(ConfigError, match=r"'nothing'.*known state keys: model, optimizer"):
        _manager(tmp_path, model2, opt2, sched2, counter2, exclude_from_loading=["nothing"])


def test_load_step(tmp_path):
    model, opt, sched, counter = _setup()
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=2)
    _train(model, opt, sched, counter, 4, mgr)
    assert open_store(tmp_path / "checkpoint").published_steps() == [2, 4]
    mgr.close()
    model2, opt2, sched2, counter2 = _setup()
    assert _manager(tmp_path, model2, opt2, sched2, counter2, load_step=2).load() == 2
    assert counter2.step == 2
    with pytest.raises(ConfigError, match=r"load_step = 3.*published steps: 2, 4"):
        _manager(tmp_path, model2, opt2, sched2, counter2, load_step=3).load()


def test_a_frozen_base_is_written_once_and_linked_only_when_it_is_still_the_same(tmp_path):
    """The model's frozen parameters (a LoRA run's base) go to a file of their own, written by
    the first save and linked (same inode) by the next ones; every step verifies and loads
    alone, an earlier one deleted. Each claim the link rests on is checked, never assumed: a
    frozen tensor changed in place through ``.data`` (its version counter unchanged), the
    previous step's file replaced by another (the same
    bytes), the previous step deleted: each time the base is written again and the step holds
    the values of the moment. With ``link_frozen = false`` every save writes it."""
    import shutil

    from dcpkit.tools.verify import verify_path

    def frozen_model(seed=0):
        model, _, _, counter = _setup(seed)
        for name, p in model.named_parameters():
            p.requires_grad_("norm" in name)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), counter

    def base(step, root=tmp_path):
        return root / "checkpoint" / f"step-{step}" / "__0_10000.distcp"

    def run(root, link):
        model, opt, sched, counter = frozen_model()
        cfg = CheckpointConfig(
            enable=True, interval=1, keep_latest_k=0, last_save_model_only=False, link_frozen=link
        )  # fmt: skip
        mgr = CheckpointManager(cfg, root, model=model, optimizer=opt, lr_scheduler=sched)
        _train(model, opt, sched, counter, 3, mgr)  # saves 1, 2, 3
        return model, mgr

    model, mgr = run(tmp_path, True)
    assert len({base(s).stat().st_ino for s in (1, 2, 3)}) == 1 and base(1).stat().st_nlink == 3
    frozen = sum(p.numel() * 4 for p in model.parameters() if not p.requires_grad)
    others = [f for f in base(3).parent.iterdir() if f != base(3)]
    assert base(1).stat().st_size >= frozen > 4 * sum(f.stat().st_size for f in others)
    version = model.tok_embeddings.weight._version
    model.tok_embeddings.weight.data.mul_(2)  # frozen, changed through .data (an EMA update's way)
    assert model.tok_embeddings.weight._version == version  # which no version counter sees
    mgr.save(4, force=True)
    assert base(4).stat().st_ino != base(3).stat().st_ino  # written, not linked
    data = base(4).read_bytes()
    base(4).unlink()
    base(4).write_bytes(data)  # the same bytes in another file: step 4 still verifies
    mgr.save(5, force=True)
    shutil.rmtree(base(5).parent)  # the previous step deleted
    mgr.save(6, force=True)
    mgr.close()
    inodes = [base(s).stat().st_ino for s in (1, 4, 6)]
    assert len(set(inodes)) == 3 and all(base(s).stat().st_nlink == 1 for s in (4, 6))
    shutil.rmtree(base(1).parent)
    for step in (2, 3, 4, 6):
        assert verify_path(base(step).parent).ok, step
    for step, doubled in ((3, False), (4, True), (6, True)):
        loaded, opt, sched, _ = frozen_model(seed=1)
        cfg = CheckpointConfig(enable=True, load_step=step)
        with CheckpointManager(
            cfg, tmp_path, model=loaded, optimizer=opt, lr_scheduler=sched
        ) as again:
            again.load()
        weight = loaded.tok_embeddings.weight
        assert torch.equal(weight, model.tok_embeddings.weight) == doubled, step
        assert torch.equal(weight * (1 if doubled else 2), model.tok_embeddings.weight)
    run(tmp_path / "unlinked", False)[1].close()
    for step in (1, 2, 3):  # the base in the step's own files, every time
        folder = base(step, tmp_path / "unlinked").parent
        assert not base(step, tmp_path / "unlinked").exists()
        assert sum(f.stat().st_size for f in folder.glob("*.distcp")) > frozen


def test_when_it_saves():
    cfg = CheckpointConfig(enable=True, interval=5, enable_first_step_checkpoint=True)
    model = build_model("llama3", "debugmodel", max_seq_len=8, n_layers=1)
    mgr = CheckpointManager(cfg, "/nonexistent-base", model)
    assert [s for s in range(1, 13) if mgr.should_save(s, last_step=s == 12)] == [1, 5, 10, 12]
    off = CheckpointManager(CheckpointConfig(enable=True, load_only=True), "/x", model)
    assert not any(off.should_save(s, last_step=True) for s in range(1, 10))
    disabled = CheckpointManager(CheckpointConfig(), "/x", model)
    assert not disabled.should_save(500) and disabled.load() is None


def test_last_save_is_model_only_in_export_dtype(tmp_path):
    model, opt, sched, counter = _setup()
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=100, export_dtype="bfloat16")
    _train(model, opt, sched, counter, 2)
    assert mgr.save(2, last_step=True)
    ckpt = tmp_path / "checkpoint" / "step-2"
    meta = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    assert set(meta) == set(model.state_dict())
    assert all(m.properties.dtype == torch.bfloat16 for m in meta.values())
    manifest = read_manifest(ckpt)
    assert manifest["model_only"] and manifest["dtype"] == "bfloat16"
    mgr.close()
    # A fresh fp32 model loads it when asked to load the model only (the rest starts fresh).
    model2, opt2, sched2, counter2 = _setup(seed=1)
    _manager(tmp_path, model2, opt2, sched2, counter2, load_model_only=True).load()
    assert model2.output.weight.dtype == torch.float32
    assert torch.equal(model2.output.weight, model.output.weight.to(torch.bfloat16).float())


def test_initial_load_path_and_seed_checkpoint(tmp_path):
    model, _, _, _ = _setup()
    seed_mgr = CheckpointManager(CheckpointConfig(enable=True, folder="seed"), tmp_path, model)
    seed_path = seed_mgr.save_seed_checkpoint()
    assert seed_path.name == "step-0"
    # A new run with an empty folder starts from the seed; the model only.
    model2, opt2, sched2, counter2 = _setup(seed=5)
    mgr = _manager(
        tmp_path / "run", model2, opt2, sched2, counter2, initial_load_path=str(seed_path)
    )
    assert mgr.load() is None  # not a step of this run's folder
    assert torch.equal(model2.norm.weight, model.norm.weight)
    assert torch.equal(model2.output.weight, model.output.weight)
    assert counter2.step == 0
    with pytest.raises(ConfigError, match="initial_load_path"):
        _manager(tmp_path / "run2", *_setup(), initial_load_path=str(tmp_path / "nope")).load()


def test_missing_parameters_are_named(tmp_path):
    model, opt, sched, counter = _setup()
    _train(
        model, opt, sched, counter, 1, _manager(tmp_path, model, opt, sched, counter, interval=1)
    )
    bigger = build_model("llama3", "debugmodel", max_seq_len=32, n_layers=3)
    mgr = CheckpointManager(CheckpointConfig(enable=True), tmp_path, bigger)
    with pytest.raises(CheckpointError, match=r"layers\.2\.attention\.wq\.weight"):
        mgr.load()


def test_retention_and_leftovers(tmp_path):
    model, opt, sched, counter = _setup()
    folder = tmp_path / "checkpoint"
    (folder / ".tmp-step-99").mkdir(parents=True)
    (folder / ".tmp-step-99" / "__0_0.distcp").write_bytes(b"partial")
    (folder / "step-50").mkdir()  # a step folder without metadata: never picked
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=1, keep_latest_k=2)
    assert open_store(folder).incomplete_names() == []  # cleaned when the manager starts
    _train(model, opt, sched, counter, 4, mgr)
    mgr.close()  # old steps are deleted in the background; the folder's lease is released
    assert open_store(folder).published_steps() == [3, 4]
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-4"]


def test_no_garbage_collection_inside_a_save_or_a_load(tmp_path):
    """The cyclic collector is paused for a whole save and a whole load, its verification
    included (a full collection there cost a 4 GiB load 0.15 s in one of four runs), and
    enabled again after, also when the load fails. With a collection due every 10 new objects,
    none may start inside a save or a load: on a thread whose stack is in one, or on one of
    their worker threads (the one due when it ends starts after it returned; other threads of
    the process, such as the test's S3 server, are not the manager's)."""
    import gc
    import sys
    import threading

    model, opt, sched, counter = _setup()
    mgr = _manager(tmp_path, model, opt, sched, counter, interval=1, verify_on_load=True)
    collections = []
    inner = {
        CheckpointManager.save.__wrapped__.__code__,
        CheckpointManager.load.__wrapped__.__code__,
    }

    def seen(phase, info):
        if phase != "start":
            return
        frame = sys._getframe(1)
        while frame is not None and frame.f_code not in inner:
            frame = frame.f_back
        if frame is not None or threading.current_thread().name.startswith("dcpkit"):
            collections.append(info["generation"])

    _train(model, opt, sched, counter, 1)
    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(10)
    gc.callbacks.append(seen)
    try:
        mgr.save(1)
        assert collections == [] and gc.isenabled()
        outside = []
        gc.callbacks.append(lambda phase, info: outside.append(phase))
        # (objects freed since the last collection count against the next one: allocate well
        # past the threshold)
        garbage = [[object()] for _ in range(5000)]
        del garbage
        gc.callbacks.pop()
        assert len(outside) > 5, "the collector did not run outside the save"
        assert mgr.load() == 1
        assert collections == [] and gc.isenabled()
        (tmp_path / "checkpoint" / "step-1" / ".metadata").write_bytes(b"not metadata")
        with pytest.raises(CheckpointError):
            mgr.load()
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*thresholds)
        mgr.close()


def test_async_mode_is_case_insensitive():
    assert CheckpointConfig(async_mode="ASYNC").async_mode == "async"
    assert CheckpointConfig(async_mode="Async_With_Pinned_Mem").async_mode == (
        "async_with_pinned_mem"
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"keep_latest_k": 1}, "keep_latest_k = 1"),
        ({"interval": 0}, "interval must be >= 1"),
        ({"async_mode": "later"}, "async_mode 'later'"),
        ({"export_dtype": "int8"}, "export_dtype 'int8'"),
        ({"folder": " "}, "folder must not be empty"),
        ({"last_save_in_hf": True, "last_save_model_only": False}, "last_save_in_hf"),
        ({"load_step": -2}, "load_step"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointConfig(**kwargs)


def test_config_from_toml(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[checkpoint]\nenable = true\ninterval = 7\nasync_mode = "DISABLED"\n')
    cfg = CheckpointConfig.from_toml(path)
    assert (cfg.enable, cfg.interval, cfg.async_mode, cfg.keep_latest_k) == (
        True,
        7,
        "disabled",
        10,
    )
    path.write_text("[checkpoint]\nintervall = 7\n")
    with pytest.raises(ConfigError, match=r"unknown option \[checkpoint\] intervall"):
        CheckpointConfig.from_toml(path)


def test_a_process_exits_cleanly_right_after_a_collective():
    """A gloo worker thread releasing a finished collective's tensors needs the GIL; a process
    that exits first aborts (SIGABRT) after its work is done: 3 or 4 of 20 plain-torch
    processes of `exit_after_gather.py torch` here. Once dcpkit has seen the group, none of 20
    may abort. The 10 pairs are forked by one process a rank (torch imported twice, not 20
    times); each still ends through the interpreter's finalization."""
    script = str(ROOT / "tests" / "scripts" / "exit_after_gather.py")
    ports = set()
    while len(ports) < 10:
        ports.add(str(free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, script, "dcpkit", *sorted(ports)],
            env=torchrun_env(
                {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"}
                | {"MASTER_ADDR": "127.0.0.1"}
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    codes = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out[-2000:]
        codes += [int(x) for x in re.findall(r"^status (-?\d+)$", out, re.M)]
    assert codes == [0] * 20, codes
