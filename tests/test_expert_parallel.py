"""Expert parallelism: experts saved sharded by expert under their plain names (with the
router's trained expert bias), resumed at the same layout bitwise and at other expert-parallel
degrees and world sizes (EP 4 -> 2 -> 1), model and optimizer state included."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import read_metrics, run_train
from dcpkit.config import ConfigError
from dcpkit.formats.dcp import DCPCheckpoint
from dcpkit.safe_pickle import load_metadata
from dcpkit.train.config import Parallelism
from dcpkit.train.parallelize import mesh_layout

pytestmark = pytest.mark.dist

DEEPSEEK = (
    "--model.name",
    "deepseek_v3",
    "--training.steps",
    "6",
    "--checkpoint.interval",
    "3",
)


def _ep(n: int) -> tuple[str, str]:
    return ("--parallelism.expert_parallel_degree", str(n))


@pytest.fixture(scope="module")
def ep4_run(tmp_path_factory) -> Path:
    """4 ranks, experts sharded over all 4 (EP 4), FSDP 4 for the rest; saves at 3 and 6."""
    dump = tmp_path_factory.mktemp("ep4")
    proc = run_train(4, dump, *DEEPSEEK, *_ep(4))
    assert "ep=4" in proc.stdout
    return dump


def _resume(src: Path, dst: Path, nproc: int, *layout: str) -> dict[int, dict]:
    (dst / "checkpoint").mkdir(parents=True)
    shutil.copytree(src / "checkpoint" / "step-3", dst / "checkpoint" / "step-3")
    proc = run_train(nproc, dst, *DEEPSEEK, *layout)
    assert "resuming after step 3" in proc.stdout
    return read_metrics(dst)


def test_ep_checkpoint_holds_each_expert_once_sharded_by_expert(ep4_run):
    step = ep4_run / "checkpoint" / "step-3"
    with open(step / ".metadata", "rb") as f:
        meta = load_metadata(f, str(step)).state_dict_metadata
    for key in ("layers.1.moe.experts.w1", "optimizer.state.layers.1.moe.experts.w1.exp_avg"):
        md = meta[key]
        assert list(md.size) == [8, 128, 256]
        offsets = sorted(c.offsets[0] for c in md.chunks)
        assert offsets == [0, 2, 4, 6]  # one chunk of two experts per expert-parallel rank
        assert all(list(c.sizes) == [2, 128, 256] for c in md.chunks)
    with DCPCheckpoint(step) as ck:
        bias = ck.read("layers.1.moe.expert_bias")
    assert bias.abs().sum() > 0  # trained by load balancing: state a resume must restore


def test_resume_at_the_same_expert_parallel_layout_is_bitwise(ep4_run, tmp_path):
    ref = read_metrics(ep4_run)
    got = _resume(ep4_run, tmp_path, 4, *_ep(4))
    for s in (4, 5, 6):
        assert got[s]["loss"] == ref[s]["loss"], s
        assert got[s]["grad_norm"] == ref[s]["grad_norm"], s


@pytest.mark.parametrize("nproc,ep", [(2, 2), (1, 1)])
def test_resume_at_another_expert_parallel_degree(ep4_run, tmp_path, nproc, ep):
    ref = read_metrics(ep4_run)
    got = _resume(ep4_run, tmp_path, nproc, *_ep(ep))
    for s in (4, 5, 6):
        a, b = ref[s]["loss"], got[s]["loss"]
        assert abs(a - b) <= 1e-3 * abs(a), (s, a, b)
        assert got[s]["tokens_seen"] == ref[s]["tokens_seen"]


def test_expert_parallel_degree_must_divide_the_fsdp_ranks():
    with pytest.raises(ConfigError, match=r"expert_parallel_degree \(3\) must divide"):
        mesh_layout(Parallelism(expert_parallel_degree=3), 4)
    assert mesh_layout(Parallelism(expert_parallel_degree=2), 4).describe().endswith("ep=2")


def test_moe_models_refuse_tensor_parallel_and_ep_with_pipelines():
    import torch

    from dcpkit.models import build_model
    from dcpkit.train.expert_parallel import check_moe_layout

    with torch.device("meta"):
        model = build_model("qwen3_moe", "debugmodel")
    with pytest.raises(ConfigError, match="expert_parallel_degree instead"):
        check_moe_layout(model, tp=2, pp=1, dp_replicate=1, ep=1)
    with pytest.raises(ConfigError, match="combines with FSDP only"):
        check_moe_layout(model, tp=1, pp=2, dp_replicate=1, ep=2)
    check_moe_layout(model, tp=1, pp=1, dp_replicate=1, ep=2)
