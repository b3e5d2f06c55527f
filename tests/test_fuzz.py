"""Fuzzing as a test: 150 seeded mutants of DCP, Hugging Face and torch.save
checkpoints through every reader (``benchmarks/fuzz.py`` runs the longer sweep)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import ROOT


def test_mutated_checkpoints_fail_cleanly(tmp_path):
    report_file = tmp_path / "fuzz.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "fuzz.py"),
            "--mutants",
            "150",
            "--seed",
            "0",
            "--json",
            str(report_file),
            "--workdir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    report = json.loads(report_file.read_text())
    assert report["mutants"] == 150
    assert set(report["by_format"]) == {"dcp", "hf", "pth"}
    assert len(report["by_mutation"]) == 6
    # Every call on every mutant ran, and none crashed, hung, blew up memory, let an exception
    # escape, or accepted corrupt data (verify of a changed checkpoint, a manager load).
    assert report["findings"] == [], proc.stdout[-3000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["outcomes"]["load ok"] == report["by_format"]["dcp"]
    assert report["outcomes"]["verify ok"] == 150
