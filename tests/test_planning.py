"""Save planning paid once: a second save of the same shapes runs no global planning."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli, run_script
from dcpkit.engine import described, planning

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["disabled", "async_with_pinned_mem"])
def test_a_second_save_of_the_same_shapes_plans_nothing(tmp_path, mode):
    if not planning.CACHING:
        pytest.skip("this torch's DCP cannot cache save plans")
    # the first save planned as DCP plans it (described.ENV=0), so that there is a plan to cache
    env = {described.ENV: "0"}
    proc = run_script(2, "plan_caching.py", str(tmp_path / "checkpoint"), mode, env=env)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    ranks = json.loads(line[len("RESULT ") :])
    # The coordinator planned the first save only; the other rank never plans.
    assert [r["counts"] for r in ranks] == [[1, 1, 1], [0, 0, 0]]
    # The saves that reused the cached plan and metadata load back bitwise.
    assert all(r["bitwise"] for r in ranks)


def _metadata(chunks, size=(8, 8)):
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )
    return Metadata({"w": md})


def test_plan_validation_finds_what_dcps_finds():
    from torch.distributed.checkpoint.default_planner import _validate_global_plan
    from torch.distributed.checkpoint.planner import SavePlan

    grid = [((r, c), (2, 4)) for r in range(0, 8, 2) for c in (0, 4)]  # 4 x 2 blocks
    cases = {
        "tiled": (grid, 0),
        "overlapping": ([*grid[:-1], ((5, 3), (2, 4))], 2),  # overlaps two blocks, 1 missing
        "out of bounds": ([*grid[:-1], ((6, 6), (2, 4))], 1),
        "not covered": (grid[:-1], 1),
    }
    for name, (chunks, n_errors) in cases.items():
        md = _metadata(chunks)
        ours = planning.validate_global_plan(md, 2)
        theirs = _validate_global_plan([SavePlan([]), SavePlan([])], md)
        assert bool(ours) == bool(theirs), name
        assert len(ours) >= n_errors, (name, ours)


def test_planning_scale_benchmark_small(tmp_path):
    out = tmp_path / "planning.json"
    # one model, 8 and 16 ranks measured, 32 extrapolated: the sweep is the benchmark's
    cmd = [sys.executable, str(ROOT / "benchmarks" / "planning_scale.py"), "--models", "8B"]
    cmd += ["--max-world", "32", "--max-items", "1e5", "--replicas", "", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    measured = [r for r in rows if r["measured"]]
    assert {(r["model"], r["world"]) for r in measured} == {("8B", 8), ("8B", 16)}
    for r in measured:
        assert r["global_plans"] == (1 if planning.CACHING else 2)
        assert r["metadata_bytes"] > 0 and r["items_after_dedup"] < r["items"]
        assert r["load_parse_s"] > 0 and r["load_check_s"] > 0  # what each rank of a load pays
        # ... and with the index instead: a rank's own chunks, its share of the checks
        assert r["index_bytes"] > 0 and r["index_s"] > 0 and r["index_check_s"] > 0
        assert r["load_index_s"] > 0 and 0 < r["index_chunks"] < r["items_after_dedup"]
        # a restart's first save: each rank takes its plan from the index (its items checked to
        # be the planning's; together, up to 64 ranks, every stored entry once), 0 plannings
        assert r["restart_claim_s"] > 0 and r["restart_metadata_s"] > 0
    # A job's first save planned from the layout the ranks share, at every size: no global
    # planning, seconds at most blocking, and its streamed .metadata read back whole.
    for r in rows:
        assert r["described_global_plans"] == 0 and r["described_plans"] == 1, r
        assert 0 < r["described_blocking_s"] < 10 and r["described_gathered_bytes"] > 0
        assert r["described_metadata_bytes"] > 0 and r["described_index_bytes"] > 0
        assert r["described_chunks_read_back"] == r["described_chunks"] > 0
    # A cell over the item budget is extrapolated, and says so.
    assert [r["world"] for r in rows if not r["measured"]] == [32]
    assert (tmp_path / "planning.png").stat().st_size > 0
    # Scale's tables render from such a run: extrapolated cells marked, every model shown.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _figures_scale as scale
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    data = json.loads(out.read_text())
    first = scale.planning(data)
    assert "| 8B, 8 | " in first and "| 8B, 32 * | " in first and "0 plannings" in first
    for render in (scale.planning_parse, scale.planning_index, scale.planning_restart):
        assert "| 32 * |" in render(data) or "| 8B, 32 * |" in render(data), render.__name__
    assert "| 32 | " in scale.planning_first_save(data)  # the first save: measured at every size


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_a_small_value_stored_many_times_is_serialized_once(tmp_path, monkeypatch, async_mode):
    """A flattened optimizer stores each hyperparameter once per parameter: a save, sync or
    from its staged copy, serializes each distinct value once, and every value loads back as it
    was, down to its type and the sign of a zero (1 and 1.0, 0.0 and -0.0 are not the same)."""
    import io
    import math

    from dcpkit import CheckpointConfig, CheckpointManager

    def model_and_opt(lr_a, lr_b, wd_b):  # type: ignore[no-untyped-def]
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
        params = list(model.parameters())
        groups = [
            {"params": params[:6], "lr": lr_a, "weight_decay": 0.0},
            {"params": params[6:], "lr": lr_b, "weight_decay": wd_b, "betas": (0.8, 0.9)},
        ]
        return model, torch.optim.AdamW(groups)

    model, opt = model_and_opt(1, 1.0, -0.0)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    calls = []
    save = torch.save

    def counting_save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if isinstance(f, io.BytesIO):
            calls.append(obj)
        return save(obj, f, *args, **kwargs)

    cfg = CheckpointConfig(enable=True, interval=1, async_mode=async_mode)
    mgr = CheckpointManager(cfg, tmp_path, model, optimizer=opt, save_rng=False)
    monkeypatch.setattr(torch, "save", counting_save)
    assert mgr.save(1)  # an interval's save: asynchronous in the async mode
    mgr.wait()
    monkeypatch.undo()
    mgr.close()
    values = [c for c in calls if not torch.is_tensor(c)]
    # 12 parameters x a dozen hyperparameters each, serialized once per distinct value
    assert 0 < len(values) <= 30, values
    assert len({repr(v) for v in values}) == len(values)

    model2, opt2 = model_and_opt(0.5, 0.5, 0.5)
    cfg = CheckpointConfig(enable=True, interval=1)
    mgr2 = CheckpointManager(cfg, tmp_path, model2, optimizer=opt2, save_rng=False)
    assert mgr2.load() == 1
    mgr2.close()
    a, b = opt2.param_groups
    assert type(a["lr"]) is int and a["lr"] == 1
    assert type(b["lr"]) is float and b["lr"] == 1.0
    assert math.copysign(1.0, a["weight_decay"]) == 1.0
    assert math.copysign(1.0, b["weight_decay"]) == -1.0
    assert tuple(b["betas"]) == (0.8, 0.9) and tuple(a["betas"]) == (0.9, 0.999)
    for p, q in zip(opt.state.values(), opt2.state.values()):
        assert torch.equal(p["exp_avg"], q["exp_avg"])


def _ranks(proc) -> list[dict]:  # type: ignore[no-untyped-def, type-arg]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.dist
@pytest.mark.skipif(not planning.CACHING, reason="this torch's DCP cannot cache save plans")
@pytest.mark.parametrize("mode", ["disabled", "async", "async_with_pinned_mem"])
def test_a_restart_at_the_same_layout_plans_nothing(tmp_path, mode):
    """A user's loop stopped and started again: the restart's first save takes its plans from
    the checkpoint it resumed from (0 plannings), and DCP's own `dcp.load` and `dcpkit verify`
    read what it wrote; a rank whose state changes later makes every rank plan again; a restart
    at another world size plans as usual."""
    folder = tmp_path / "ckpt"
    first = _ranks(run_script(2, "restart_plans.py", str(folder), "first", mode))
    # a fresh job: its first save planned from the layout the ranks share, then cached
    assert [r["plans"] for r in first] == [[0, 0], [0, 0]]
    proc = run_script(2, "restart_plans.py", str(folder), "restart", mode)
    restart = _ranks(proc)
    # step 3 planned by step 2's checkpoint; at step 4 rank 1's state gains a key: all plan
    assert [r["plans"] for r in restart] == [[0, 1], [0, 0]], restart
    assert "save takes its plans from step 2" in proc.stderr + proc.stdout
    for step in (3, 4):
        assert cli("verify", str(folder / f"step-{step}")).returncode == 0
        check = _ranks(run_script(2, "restart_plans.py", str(folder), "check", mode, str(step)))
        assert [r["step"] for r in check] == [step, step]
        assert all(r["bitwise"] for r in check), check
        assert [r["reader"]["position"] for r in check] == [step, 100 + step]
    assert check[0]["stored_reader"] == [  # rank 1's new key is in step 4's metadata
        "reader.rank_0.position",
        "reader.rank_1.extra",
        "reader.rank_1.position",
    ]
    other = run_script(1, "restart_plans.py", str(folder), "restart", mode)
    assert [r["plans"] for r in _ranks(other)] == [[1, 1]]  # another world size: planned
    assert "the layout differs from step 4's" in other.stderr + other.stdout


@pytest.mark.dist
@pytest.mark.skipif(not planning.CACHING, reason="this torch's DCP cannot cache save plans")
def test_a_restart_from_an_object_store_plans_nothing(seaweedfs, monkeypatch):
    """The same on S3 (SeaweedFS): the index the load downloaded serves the first save, which
    plans nothing, and what it wrote verifies."""
    import uuid

    import s3fs

    from conftest import BUCKET, use_endpoint

    use_endpoint(monkeypatch, seaweedfs)
    try:
        folder = f"s3://{BUCKET}/restart-{uuid.uuid4().hex}/checkpoint"
        env = {described.ENV: "0"}  # a first save planned as DCP plans it, for the restart
        first = _ranks(run_script(2, "restart_plans.py", folder, "first", "disabled", env=env))
        assert [r["plans"] for r in first] == [[1, 1], [0, 0]]
        proc = run_script(2, "restart_plans.py", folder, "restart", "async")
        assert [r["plans"] for r in _ranks(proc)] == [[0, 1], [0, 0]]
        assert "save takes its plans from step 2" in proc.stderr + proc.stdout
        for step in (3, 4):
            proc = cli("verify", f"{folder}/step-{step}")
            assert proc.returncode == 0, proc.stdout + proc.stderr
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.dist
@pytest.mark.skipif(not planning.CACHING, reason="this torch's DCP cannot cache save plans")
def test_a_restart_with_empty_shards_plans_nothing(tmp_path):
    """A (1, 4) parameter over 2 ranks gives rank 1 an empty shard, and a (0, 4) one is empty
    everywhere: the first save lists no empty chunk, and the restart's first save still takes
    its plans from the checkpoint (0 plannings); what it wrote verifies and DCP's own load reads
    it bit for bit."""
    folder = tmp_path / "ckpt"
    env = {"EMPTY_SHARDS": "1"}
    first = _ranks(run_script(2, "restart_plans.py", str(folder), "first", "disabled", env=env))
    assert [r["plans"] for r in first] == [[0, 0], [0, 0]]
    proc = run_script(2, "restart_plans.py", str(folder), "restart", "disabled", env=env)
    assert [r["plans"] for r in _ranks(proc)] == [[0, 1], [0, 0]]
    assert "save takes its plans from step 2" in proc.stderr + proc.stdout
    assert "the layout differs" not in proc.stderr + proc.stdout
    assert cli("verify", str(folder / "step-3")).returncode == 0
    check = _ranks(
        run_script(2, "restart_plans.py", str(folder), "check", "disabled", "3", env=env)
    )
    assert all(r["bitwise"] for r in check), check
