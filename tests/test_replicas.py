"""Replicas read once: a resume in which several ranks need the same stored bytes (HSDP's
replicate dimension, a replicated (DDP) layout) reads each record from storage once and shares
it over the process group, and resumes bit for bit; the bytes read are counted and logged."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from conftest import read_metrics, run_train

pytestmark = pytest.mark.dist

STEPS = ("--training.steps", "8", "--checkpoint.interval", "4")
LAYOUTS = {
    "hsdp-2x2": (4, 2, 2),  # ranks, dp_replicate, dp_shard
    "ddp-2": (2, 2, 1),
    "ddp-4": (4, 4, 1),
}
READ = re.compile(
    r"checkpoint: read ([\d.]+ \w+) from storage for ([\d.]+ \w+) stored \(([\d.]+)x\)"
)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_replicated_resume_reads_the_checkpoint_once_and_is_bitwise(layout, tmp_path):
    nproc, rep, shard = LAYOUTS[layout]
    args = (
        *STEPS,
        "--parallelism.data_parallel_replicate_degree",
        str(rep),
        "--parallelism.data_parallel_shard_degree",
        str(shard),
    )
    full = tmp_path / "full"
    run_train(nproc, full, *args)
    ref = read_metrics(full)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoint").mkdir(parents=True)
    step = full / "checkpoint" / "step-4"
    shutil.copytree(step, resumed / "checkpoint" / "step-4")
    proc = run_train(nproc, resumed, *args)
    assert "resuming after step 4" in proc.stdout
    got = read_metrics(resumed)
    for s in range(5, 9):
        assert got[s]["loss"] == ref[s]["loss"], (s, got[s]["loss"], ref[s]["loss"])
    found = READ.search(proc.stdout + proc.stderr)
    assert found, proc.stdout[-3000:]
    ratio = float(found.group(3))
    stored = sum(p.stat().st_size for p in Path(step).glob("*.distcp"))
    assert ratio <= 1.05, (ratio, found.group(0), stored)
    assert ratio >= 0.99  # every byte of the data files read (and checksummed) once
    assert "(records read once, sent)" in found.string[found.end() : found.end() + 40]


def test_a_corrupted_file_in_a_shared_load_is_named_and_no_rank_waits(tmp_path):
    """A flipped bit in one rank's file of a replicated checkpoint: the rank that reads it for
    everyone finds the checksum wrong, the others load what it sent, and every rank stops with
    the file named (no rank left waiting in a transfer)."""
    args = (
        *STEPS,
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
    )
    run_train(2, tmp_path, *args, "--training.stop_at_step", "4")
    target = tmp_path / "checkpoint" / "step-4" / "__1_0.distcp"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    proc = run_train(2, tmp_path, *args, check=False, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "__1_0.distcp" in out and "checksum mismatch" in out, out[-3000:]
