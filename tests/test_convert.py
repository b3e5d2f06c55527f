"""Conversions: DCP <-> torch.save <-> HF safetensors, against real torch/transformers readers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from conftest import cli, hf_tensors
from dcpkit.convert.adapters import get_adapter
from dcpkit.convert.hf import from_hf, to_hf
from dcpkit.convert.torch_save import from_torch, to_torch
from dcpkit.formats.dcp import DCPCheckpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _ckpt(run: Path, step: int = 10) -> Path:
    return run / "checkpoint" / f"step-{step}"


def _same_tensors(a: Path, b: Path, keys=None) -> int:
    with DCPCheckpoint(a) as x, DCPCheckpoint(b) as y:
        keys = keys or list(x.tensors)
        assert set(keys) <= set(y.tensors)
        for k in keys:
            assert torch.equal(x.read(k), y.read(k)), k
    return len(keys)


_hf_tensors = hf_tensors


def test_dcp_to_hf_to_dcp_is_bitwise_and_loads_in_transformers(stopped_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _ckpt(stopped_run)
    hf = tmp_path / "hf"
    result = to_hf(
        src,
        hf,
        "llama3",
        "debugmodel",
        tokenizer=stopped_run / "tokenizer.json",
        max_shard_size="5MB",
        verify=True,
    )
    assert result.max_tensor_diff == 0.0
    assert result.max_logits_diff is not None and result.max_logits_diff < 1e-4
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[0].endswith(f"-of-{len(shards):05d}.safetensors")
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    config = json.loads((hf / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_theta"] == 500000
    assert config["num_key_value_heads"] == 16 and config["head_dim"] == 16

    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(hf))
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "def add(a, b):\n    return"
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 5

    back = tmp_path / "back"
    result = from_hf(hf, back, "llama3", verify=True)
    assert result.flavor == "debugmodel"
    assert _same_tensors(back, src) == 57  # every model tensor, bitwise


def test_dcp_to_torch_to_dcp_is_bitwise(stopped_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    src = _ckpt(stopped_run)
    pth = tmp_path / "full.pth"
    to_torch(src, pth, budget=64 << 10)  # a small budget: tensors move in row blocks
    ours = torch.load(pth, weights_only=False)
    ref_path = tmp_path / "ref.pth"
    dcp_to_torch_save(str(src), str(ref_path))
    ref = torch.load(ref_path, weights_only=False)

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    ours_flat, ref_flat = dict(flat(ours)), dict(flat(ref))
    assert ours_flat.keys() == ref_flat.keys()
    for k, v in ref_flat.items():
        if torch.is_tensor(v):
            assert torch.equal(ours_flat[k], v), k
        else:
            assert ours_flat[k] == v, k

    back = tmp_path / "back"
    from_torch(pth, back, budget=64 << 10)
    assert _same_tensors(src, back) == len(DCPCheckpoint(src).tensors)
    with DCPCheckpoint(src) as a, DCPCheckpoint(back) as b:
        assert set(a.objects) == set(b.objects)
        for k in a.objects:
            assert a.read_object(k) == b.read_object(k), k

    model_pth = tmp_path / "model.pth"
    to_torch(src, model_pth, model_only=True)
    from dcpkit.models import build_model

    model = build_model("llama3", "debugmodel", max_seq_len=16)
    model.load_state_dict(torch.load(model_pth, weights_only=True), strict=True)


def test_small_budget_hf_round_trip_uses_row_blocks(stopped_run, tmp_path):
    src = _ckpt(stopped_run)
    to_hf(src, tmp_path / "hf", "llama3", "debugmodel", budget=32 << 10)
    big = to_hf(src, tmp_path / "hf_big", "llama3", "debugmodel")
    assert big.tensors == 57
    small, ref = _hf_tensors(tmp_path / "hf"), _hf_tensors(tmp_path / "hf_big")
    assert small.keys() == ref.keys()
    for k in ref:
        assert torch.equal(small[k], ref[k]), k
    from_hf(tmp_path / "hf", tmp_path / "back", "llama3", budget=32 << 10)
    with DCPCheckpoint(tmp_path / "back") as back:
        assert len(back.tensors["tok_embeddings.weight"].chunks) > 1  # written in row chunks
    _same_tensors(tmp_path / "back", src)


def test_conversions_checksum_what_they_write(stopped_run, tmp_path, monkeypatch):
    """The manifest of a conversion's output holds each file's checksum, taken on the bytes as
    they were written: the big files (shards, DCP data) are not read back for it, and every
    recorded checksum is the file's (an integrity check reads each one)."""
    import dcpkit.storage.local as local
    from dcpkit.integrity import verify_checkpoint
    from dcpkit.storage import open_location

    read_back: list[str] = []
    real = local.checksum_stream

    def recording(f):  # type: ignore[no-untyped-def]
        read_back.append(Path(f.name).name)
        return real(f)

    monkeypatch.setattr(local, "checksum_stream", recording)
    src = _ckpt(stopped_run)
    to_hf(src, tmp_path / "hf", "llama3", "debugmodel", budget=32 << 10, max_shard_size="300KB")
    from_hf(tmp_path / "hf", tmp_path / "back", "llama3", budget=32 << 10)
    to_torch(src, tmp_path / "model.pth")
    from_torch(tmp_path / "model.pth", tmp_path / "back_torch", budget=64 << 10)
    shards = sorted(p.name for p in (tmp_path / "hf").glob("*.safetensors"))
    assert len(shards) > 1
    big = [n for n in read_back if n.endswith((".safetensors", ".distcp"))]
    assert big == [], big
    for out in ("hf", "back", "back_torch"):
        store, name = open_location(tmp_path / out)
        report = verify_checkpoint(store, name)
        assert report.ok and report.checksummed and report.files_checked >= 2, (out, report)
    # DCP files are written without torch.save's CRC-32 (the manifest covers them); torch's
    # process-wide setting is back as it was.
    import zipfile

    assert torch.serialization.get_crc32_options()
    data = next((tmp_path / "back").glob("*.distcp")).read_bytes()
    crcs = {i.CRC for i in zipfile.ZipFile(io.BytesIO(data)).infolist() if i.file_size}
    assert crcs == {0}


def test_newer_torchtitan_dialect_exports_the_same(stopped_run, tmp_path):
    src = _ckpt(stopped_run)
    with DCPCheckpoint(src) as c:
        state = {}
        for k in c.tensors:
            if k.startswith(("optimizer", "rng")):
                continue
            new = k.replace(".attention.wq.", ".attention.qkv_linear.wq.")
            new = new.replace(".attention.wk.", ".attention.qkv_linear.wk.")
            new = new.replace(".attention.wv.", ".attention.qkv_linear.wv.")
            state["lm_head.weight" if new == "output.weight" else new] = c.read(k)
    newer = tmp_path / "newer"
    dcp.save(state, checkpoint_id=str(newer), no_dist=True)
    to_hf(newer, tmp_path / "a", "llama3", "debugmodel")
    to_hf(src, tmp_path / "b", "llama3", "debugmodel")
    a, b = _hf_tensors(tmp_path / "a"), _hf_tensors(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save_pretrained(family: str, folder: Path) -> dict[str, torch.Tensor]:
    import transformers

    adapter = get_adapter(family)
    args = adapter.resolve_flavor("debugmodel")
    config_dict = adapter.hf_config(args, torch.bfloat16, None, None)
    cls_name = config_dict["architectures"][0]
    config_cls = transformers.AutoConfig.for_model(config_dict["model_type"]).__class__
    config = config_cls(**{k: v for k, v in config_dict.items() if k != "architectures"})
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config).to(torch.bfloat16)
    with torch.no_grad():  # norms initialised to ones would hide a swapped or missing norm
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder), max_shard_size="4MB")
    return _hf_tensors(folder)


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_save_pretrained_folder_round_trips(family, tmp_path):
    original = _save_pretrained(family, tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1  # several shards
    assert all(t.dtype == torch.bfloat16 for t in original.values())
    result = from_hf(tmp_path / "hf", tmp_path / "dcp", family, verify=True)
    assert result.flavor == "debugmodel"
    with DCPCheckpoint(tmp_path / "dcp") as c:
        assert c.dtype("tok_embeddings.weight") == torch.bfloat16
        if family == "qwen3":  # tied: output.weight is the embedding
            assert "layers.0.attention.q_norm.weight" in c.tensors
            assert torch.equal(c.read("output.weight"), c.read("tok_embeddings.weight"))
    result = to_hf(
        tmp_path / "dcp",
        tmp_path / "again",
        family,
        "debugmodel",
        max_shard_size="4MB",
        verify=True,
    )
    # transformers' logits against dcpkit's own model of the family, both in float32
    assert result.max_logits_diff is not None and result.max_logits_diff < 1e-4, result.notes
    again = _hf_tensors(tmp_path / "again")
    assert again.keys() == original.keys()
    for k, v in original.items():
        assert torch.equal(again[k], v), k


# --- bad inputs, through the command line ----------------------------------------------------


def _assert_clean_failure(proc, expected: str, out: Path | None = None) -> None:
    assert proc.returncode != 0
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    if out is not None:
        assert not out.exists()
        assert not list(out.parent.glob(f".tmp-{out.name}*"))


def test_bad_inputs_fail_cleanly(stopped_run, tmp_path):
    src = str(_ckpt(stopped_run))
    out = tmp_path / "out"
    _assert_clean_failure(
        cli("to-hf", src, str(out), "--flavor", "8B"), "lacks 234 llama3 8B parameter(s)", out
    )
    _assert_clean_failure(
        cli("to-hf", src, str(out), "--flavor", "9B"),
        "unknown llama3 flavor '9B'; known flavors: debugmodel",
        out,
    )
    _assert_clean_failure(
        cli("to-hf", src, str(out), "--model", "gpt2", "--flavor", "x"),
        "invalid choice: 'gpt2'",
        out,
    )
    _assert_clean_failure(
        cli("to-hf", str(tmp_path / "nope"), str(out), "--flavor", "debugmodel"),
        "does not exist",
        out,
    )
    _assert_clean_failure(
        cli("to-hf", str(stopped_run / "checkpoint"), str(out), "--flavor", "debugmodel"),
        "has no .metadata",
        out,
    )
    _assert_clean_failure(
        cli("to-torch", str(tmp_path), str(tmp_path / "x.pth")),
        "is not a DCP checkpoint",
        tmp_path / "x.pth",
    )
    _assert_clean_failure(cli("from-hf", str(tmp_path), str(out)), "holds no safetensors", out)
    _assert_clean_failure(
        cli("from-torch", str(tmp_path / "missing.pth"), str(out)), "does not exist", out
    )

    # A truncated .metadata.
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    meta = broken / ".metadata"
    meta.write_bytes(meta.read_bytes()[:100])
    _assert_clean_failure(
        cli("to-torch", str(broken), str(tmp_path / "b.pth")),
        "truncated or corrupt",
        tmp_path / "b.pth",
    )

    # A parameter the key map does not know.
    with DCPCheckpoint(src) as c:
        state = {k: c.read(k) for k in c.tensors if not k.startswith(("optimizer", "rng"))}
    state["layers.0.attention.extra_gate.weight"] = torch.zeros(4)
    odd = tmp_path / "odd"
    dcp.save(state, checkpoint_id=str(odd), no_dist=True)
    _assert_clean_failure(
        cli("to-hf", str(odd), str(out), "--flavor", "debugmodel"),
        "layers.0.attention.extra_gate.weight in",
        out,
    )

    # A shape that does not match the flavor.
    state.pop("layers.0.attention.extra_gate.weight")
    state["norm.weight"] = torch.ones(300)
    wrong = tmp_path / "wrong"
    dcp.save(state, checkpoint_id=str(wrong), no_dist=True)
    _assert_clean_failure(
        cli("to-hf", str(wrong), str(out), "--flavor", "debugmodel"), "norm.weight in", out
    )

    # An existing output is not replaced without --force.
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = cli("to-hf", src, str(out), "--flavor", "debugmodel")
    assert proc.returncode != 0 and "--force" in proc.stderr
    assert (out / "keep.txt").read_text() == "mine"


def test_seed_spellings_of_convert_to_hf(stopped_run, tmp_path):
    proc = cli(
        "to-hf",
        "--ckpt_path",
        str(_ckpt(stopped_run)),
        "--output_path",
        str(tmp_path / "hf"),
        "--model_name",
        "llama3",
        "--flavor",
        "debugmodel",
        "--tokenizer_path",
        str(stopped_run / "tokenizer.json"),
        "--dtype",
        "bfloat16",
    )
    assert proc.returncode == 0, proc.stderr
    assert "to-hf: 57 tensors" in proc.stdout
    tensors = _hf_tensors(tmp_path / "hf")
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_recycled_blocks_reuse_only_what_nothing_holds():
    """Inside ``recycled_blocks`` a block's memory is handed out again once nothing uses it (a
    tensor of it, or a view of that tensor, keeps it); outside, every block is fresh."""
    from dcpkit.formats.blocks import block, empty, recycled_blocks

    with recycled_blocks():
        a = torch.frombuffer(block(1 << 20), dtype=torch.uint8)
        a.fill_(1)
        first = a.data_ptr()
        kept = a[10:20]  # a view of the tensor holds the block
        del a
        b = torch.frombuffer(block(1 << 20), dtype=torch.uint8)
        assert b.data_ptr() != first
        b.fill_(2)
        assert bool((kept == 1).all())  # not overwritten
        del kept
        c = empty((256, 1024), torch.float32)  # 1 MiB: the first block is free again
        assert c.data_ptr() == first and c.shape == (256, 1024)
        second = b.data_ptr()
        del b
        small = empty((3,), torch.float64)  # a smaller block fits in a free larger one
        assert small.data_ptr() == second
    fresh = block(1 << 10)
    assert isinstance(fresh, bytearray) and not any(fresh)  # outside: fresh zeros
