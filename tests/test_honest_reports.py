"""Reports say exactly what they checked: a ``torch.save`` export carries true CRC-32s that
``verify`` checks (and says so when a file has none); ``to-hf --verify`` compares the export with
the source checkpoint's own model and states the tolerance its dtype implies; ``list
--checksums`` fails on a corrupt step."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import cli
from dcpkit.convert.torch_save import to_torch

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _ckpt(run: Path, step: int = 10) -> Path:
    return run / "checkpoint" / f"step-{step}"


@pytest.mark.parametrize("model_only", [False, True], ids=["full", "model_only"])
def test_to_torch_exports_carry_true_crcs_under_their_own_name(stopped_run, tmp_path, model_only):
    out = tmp_path / "exported.model.pth"
    to_torch(_ckpt(stopped_run), out, model_only=model_only)
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None
        names = archive.namelist()
        assert all(n.startswith("exported.model/") for n in names), names[:3]
        data = [i for i in archive.infolist() if "/data/" in i.filename and i.file_size]
        assert data and all(i.CRC != 0 for i in data)
    state = torch.load(out, weights_only=True)
    assert state  # torch reads it as it reads any torch.save file
    proc = cli("verify", str(out))
    assert proc.returncode == 0, proc.stdout
    count = len(names)
    assert f"structure intact, the CRC-32 of {count} record(s) match" in proc.stdout


def test_verify_fails_on_a_flipped_byte_anywhere_in_an_export(stopped_run, tmp_path):
    clean = tmp_path / "model.pth"
    to_torch(_ckpt(stopped_run), clean, model_only=True)
    raw = clean.read_bytes()
    with zipfile.ZipFile(clean) as archive:
        records = [
            (i.header_offset, i.file_size, i.filename)
            for i in archive.infolist()
            if i.file_size > 64
        ]
    positions = []
    for header, size, name in records[:1] + records[len(records) // 2 :][:1] + records[-1:]:
        local = raw[header : header + 30]
        start = header + 30 + int.from_bytes(local[26:28], "little")
        start += int.from_bytes(local[28:30], "little")
        positions += [(start, name), (start + size // 2, name), (start + size - 1, name)]
    assert len(positions) >= 6
    for at, name in positions:
        bad = bytearray(raw)
        bad[at] ^= 0x01
        damaged = tmp_path / "damaged.pth"
        damaged.write_bytes(bytes(bad))
        proc = cli("verify", str(damaged))
        assert proc.returncode == 1, (at, name, proc.stdout)
        assert "FAILED" in proc.stdout and "fails its CRC-32 check" in proc.stdout


def test_verify_says_when_nothing_could_be_checksummed(tmp_path):
    path = tmp_path / "bare.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.arange(16.0)}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    proc = cli("verify", str(path))
    assert proc.returncode == 0
    assert "nothing could be checksummed" in proc.stdout
    assert "match" not in proc.stdout


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    seeded = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=seeded)
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_to_hf_verify_reports_the_true_difference_from_the_source(stopped_run, tmp_path, dtype):
    src = str(_ckpt(stopped_run))
    exact, rounded = tmp_path / "f32", tmp_path / dtype
    assert cli("to-hf", src, str(exact), "--flavor", "debugmodel").returncode == 0
    proc = cli("to-hf", src, str(rounded), "--flavor", "debugmodel", "--dtype", dtype, "--verify")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = re.search(
        r"export vs the source checkpoint's model, max abs diff ([\d.e+-]+), within the "
        r"tolerance ([\d.e+-]+) \(" + dtype,
        proc.stdout,
    )
    assert found, proc.stdout
    reported, tolerance = float(found.group(1)), float(found.group(2))
    true = float((_logits(rounded) - _logits(exact)).abs().max())  # the f32 export is the source
    assert true > 1e-3  # rounding the weights moves the logits: a report of ~1e-6 would be false
    assert abs(reported - true) <= 1e-4 + 0.02 * true
    assert tolerance > reported
    assert "runs the exported weights as dcpkit's model does" in proc.stdout


def test_the_export_carries_crcs_even_while_torch_has_them_off(stopped_run, tmp_path):
    """A DCP save elsewhere in the process turns torch's CRC-32 off (it is checksummed by the
    manifest instead): an export made meanwhile still stores every record's CRC-32."""
    out = tmp_path / "m.pth"
    torch.serialization.set_crc32_options(False)
    try:
        to_torch(_ckpt(stopped_run), out, model_only=True)
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(out) as archive:
        assert archive.testzip() is None
        assert all(i.CRC != 0 for i in archive.infolist() if i.file_size)
