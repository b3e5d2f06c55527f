"""inspect / verify / diff / list, checksums, and clean failures on bad input."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from conftest import cli
from dcpkit import CheckpointConfig, CheckpointError, CheckpointManager
from dcpkit.convert.hf import to_hf
from dcpkit.layout import MANIFEST
from dcpkit.manifest import SEAL, sealed_bytes
from dcpkit.models import build_model
from dcpkit.tools.verify import verify_path

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def ckpt(stopped_run, tmp_path) -> Path:
    """A private copy of the 2-rank step-10 training checkpoint."""
    dst = tmp_path / "checkpoint" / "step-10"
    shutil.copytree(stopped_run / "checkpoint" / "step-10", dst)
    return dst


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_verify_names_every_flipped_file(ckpt, tmp_path):
    report = verify_path(ckpt)
    assert report.ok and report.checksummed and report.files_checked == 4
    proc = cli("verify", str(ckpt))
    assert proc.returncode == 0 and proc.stdout.startswith("OK:")
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == [".metadata", ".metadata.index", "__0_0.distcp", "__1_0.distcp", "dcpkit.json"]
    for name in files:
        size = (ckpt / name).stat().st_size
        for offset in (0, size // 2, size - 1):
            copy = tmp_path / f"flip-{name}-{offset}"
            shutil.copytree(ckpt, copy)
            _flip(copy / name, offset)
            report = verify_path(copy)
            assert not report.ok, (name, offset)
            assert {p.file for p in report.problems} == {name}, (name, offset, report.problems)
    # Through the command line: a non-zero exit and the file named.
    copy = tmp_path / "cli-flip"
    shutil.copytree(ckpt, copy)
    _flip(copy / "__1_0.distcp", 12345)
    proc = cli("verify", str(copy))
    assert proc.returncode == 1
    assert "__1_0.distcp: checksum mismatch" in proc.stdout


def test_the_console_script_is_a_process_like_any_other(ckpt, tmp_path):
    """The installed `dcpkit` command (the other tests call its `main` in their own process):
    exit 0 on a good checkpoint, 1 with the file named on a damaged one, 2 without a traceback
    on a missing path."""
    command = str(Path(sys.executable).parent / "dcpkit")
    proc = subprocess.run([command, "verify", str(ckpt)], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("OK:"), proc.stderr
    copy = tmp_path / "flipped"
    shutil.copytree(ckpt, copy)
    _flip(copy / "__0_0.distcp", 4321)
    proc = subprocess.run([command, "verify", str(copy)], capture_output=True, text=True)
    assert proc.returncode == 1 and "__0_0.distcp: checksum mismatch" in proc.stdout
    missing = str(tmp_path / "missing")
    proc = subprocess.run([command, "inspect", missing], capture_output=True, text=True)
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_verify_finds_truncation_and_strays(ckpt):
    data = (ckpt / "__0_0.distcp").read_bytes()
    (ckpt / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    (ckpt / "stray.bin").write_bytes(b"x")
    problems = [str(p) for p in verify_path(ckpt).problems]
    assert any(p.startswith("__0_0.distcp: has") and "truncated" in p for p in problems)
    assert any(p.startswith("__0_0.distcp: is") and "too short" in p for p in problems)
    assert "stray.bin: is not listed in the manifest" in problems


def test_inspect_two_rank_checkpoint(ckpt):
    proc = cli("inspect", str(ckpt))
    assert proc.returncode == 0
    assert "rank 0   __0_0.distcp" in proc.stdout and "rank 1   __1_0.distcp" in proc.stdout
    assert "tok_embeddings.weight" in proc.stdout and "2048x256" in proc.stdout
    info = json.loads(cli("inspect", str(ckpt), "--json").stdout)
    assert set(info) >= {
        "path",
        "format",
        "step",
        "world_size",
        "published",
        "complete",
        "problems",
        "tensors",
        "objects",
        "groups",
        "files",
        "total_bytes",
    }
    assert info["format"] == "dcp" and info["step"] == 10 and info["world_size"] == 2
    assert info["published"] and info["complete"] and info["problems"] == []
    tensors = {t["name"]: t for t in info["tensors"]}
    emb = tensors["tok_embeddings.weight"]
    assert emb == {
        "name": "tok_embeddings.weight",
        "group": "model",
        "dtype": "float32",
        "shape": [2048, 256],
        "bytes": 2048 * 256 * 4,
        "shards": 2,
    }
    assert tensors["optimizer.state.norm.weight.exp_avg"]["group"] == "optimizer"
    assert info["groups"]["model"]["tensors"] == 57
    assert info["groups"]["model"]["bytes"] == 6_163_712 * 4
    assert {f["rank"] for f in info["files"]} == {0, 1, None}
    assert "train_state.step" in info["objects"]
    assert info["total_bytes"] == sum(p.stat().st_size for p in ckpt.iterdir())


def test_inspect_hf_and_torch_files(ckpt, tmp_path):
    to_hf(ckpt, tmp_path / "hf", "llama3", "debugmodel")
    info = json.loads(cli("inspect", str(tmp_path / "hf"), "--json").stdout)
    assert info["format"] == "hf-safetensors" and info["complete"]
    assert {t["name"] for t in info["tensors"]} >= {"model.embed_tokens.weight", "lm_head.weight"}
    from dcpkit.convert.torch_save import to_torch

    to_torch(ckpt, tmp_path / "m.pth", model_only=True)
    info = json.loads(cli("inspect", str(tmp_path / "m.pth"), "--json").stdout)
    assert info["format"] == "torch-save" and len(info["tensors"]) == 57


def test_diff_against_own_export_and_later_step(ckpt, stopped_run, reference_run, tmp_path):
    hf = tmp_path / "hf"
    to_hf(ckpt, hf, "llama3", "debugmodel")
    proc = cli("diff", str(ckpt), str(hf))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "57 tensors compared: 57 identical" in proc.stdout
    proc = cli("diff", str(hf), str(ckpt))  # either order
    assert proc.returncode == 0
    later = reference_run / "checkpoint" / "step-20"
    proc = cli("diff", str(ckpt), str(later))
    assert proc.returncode == 1
    assert "differs:   tok_embeddings.weight" in proc.stdout
    assert "differs:   optimizer.state.tok_embeddings.weight.exp_avg" in proc.stdout
    # The same step of two bitwise-identical runs: no difference at all (228 model and
    # optimizer tensors, and each rank's RNG state as 3 tensors).
    proc = cli("diff", str(ckpt), str(reference_run / "checkpoint" / "step-10"))
    assert proc.returncode == 0 and "234 tensors compared: 234 identical" in proc.stdout


def test_list_shows_status(ckpt, tmp_path):
    folder = ckpt.parent
    shutil.copytree(ckpt, folder / "step-20")
    manifest = json.loads((folder / "step-20" / MANIFEST).read_text())
    manifest.pop(SEAL)
    manifest["step"] = 20  # a step of its own, one of whose files is then cut short
    (folder / "step-20" / MANIFEST).write_bytes(sealed_bytes(manifest))
    (folder / "step-20" / "__1_0.distcp").write_bytes(b"short")
    (folder / ".tmp-step-30").mkdir()
    proc = cli("list", str(folder))
    assert proc.returncode == 1  # a corrupt step fails the command, not only its line
    assert "1 checkpoint(s) failed verification: step-20" in proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert "published, 2 rank(s); sizes and structure verified" in lines["step-10"]
    assert "CORRUPT" in lines["step-20"] and "__1_0.distcp" in lines["step-20"]
    assert "incomplete" in lines[".tmp-step-30"]
    shutil.rmtree(folder / "step-20")
    proc = cli("list", str(folder), "--checksums")
    assert proc.returncode == 0
    assert "sizes, structure and checksums verified" in proc.stdout
    data = folder / "step-10" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # the same size: only the checksum can tell
    data.write_bytes(bytes(raw))
    assert cli("list", str(folder)).returncode == 0
    proc = cli("list", str(folder), "--checksums")
    assert proc.returncode == 1 and "CORRUPT" in proc.stdout


def test_manager_refuses_corrupt_latest_and_can_fall_back(tmp_path, caplog):
    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", max_seq_len=16, n_layers=1)
    cfg = CheckpointConfig(enable=True, interval=1)
    mgr = CheckpointManager(cfg, tmp_path, model)
    mgr.save(1)
    with torch.no_grad():
        model.norm.weight.add_(1.0)
    mgr.save(2)
    mgr.close()
    _flip(tmp_path / "checkpoint" / "step-2" / "__0_0.distcp", 100)
    fresh = build_model("llama3", "debugmodel", max_seq_len=16, n_layers=1)
    with pytest.raises(CheckpointError, match=r"step-2 failed verification: __0_0.distcp"):
        CheckpointManager(cfg, tmp_path, fresh).load()
    fallback = CheckpointConfig(enable=True, interval=1, fallback_on_corruption=True)
    with caplog.at_level(logging.WARNING, logger="dcpkit"):
        assert CheckpointManager(fallback, tmp_path, fresh).load() == 1
    assert "falling back to" in caplog.text
    assert torch.equal(fresh.norm.weight, torch.ones(256))  # step 1's value


# --- bad inputs for every subcommand ---------------------------------------------------------

COMMANDS = {
    "inspect": lambda p, o: ["inspect", p],
    "verify": lambda p, o: ["verify", p],
    "diff": lambda p, o: ["diff", p, p],
    "list": lambda p, o: ["list", p],
    "to-torch": lambda p, o: ["to-torch", p, o + ".pth"],
    "to-hf": lambda p, o: ["to-hf", p, o, "--flavor", "debugmodel"],
    "from-torch": lambda p, o: ["from-torch", p, o],
    "from-hf": lambda p, o: ["from-hf", p, o],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_missing_path(command, tmp_path):
    proc = cli(*COMMANDS[command](str(tmp_path / "missing"), str(tmp_path / "out")))
    assert proc.returncode != 0
    assert "missing" in proc.stderr and "does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - {"list"}))
def test_not_a_checkpoint(command, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "readme.txt").write_text("hello")
    target = folder if command != "from-torch" else folder / "readme.txt"
    proc = cli(*COMMANDS[command](str(target), str(tmp_path / "out")))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    message = proc.stderr + proc.stdout
    assert "not a" in message or "holds no" in message
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["inspect", "verify", "diff", "to-torch", "to-hf"])
def test_truncated_metadata(command, ckpt, tmp_path):
    meta = ckpt / ".metadata"
    meta.write_bytes(meta.read_bytes()[:200])
    proc = cli(*COMMANDS[command](str(ckpt), str(tmp_path / "out")))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert ".metadata" in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists()


def _run_as_unprivileged(argv: list[str]) -> tuple[int, str]:
    """Run the CLI in a forked child without root's file permissions (when we are root)."""
    import dcpkit.cli
    import dcpkit.convert.hf
    import dcpkit.convert.torch_save
    import dcpkit.tools.diff
    import dcpkit.tools.inspect

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 99
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            err = io.StringIO()
            with redirect_stderr(err), redirect_stdout(io.StringIO()):
                code = dcpkit.cli.main(argv)
            os.write(w, err.getvalue().encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        stderr = f.read()
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stderr


@pytest.mark.parametrize("command", ["inspect", "verify", "to-torch", "to-hf"])
def test_permission_error(command, ckpt, tmp_path):
    os.chmod(ckpt / ".metadata", 0)
    os.chmod(tmp_path, 0o777)
    code, stderr = _run_as_unprivileged(COMMANDS[command](str(ckpt), str(tmp_path / "out")))
    assert code != 0
    assert "permission denied" in stderr.lower(), stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists()


def test_the_report_counts_a_save_as_the_demo_does(tmp_path):
    """The report's stall per save: the save's step and the next (which waits for an async
    copy), a process's first save left out and named; the next step's stall in ms, not 0.000."""
    import html
    import json

    lines = [{"event": "start", "world_size": 1, "config": {}}]
    stalls = {2: (0.7, 0.004), 4: (0.03, 0.002), 6: (0.05, 0.002)}
    for step in range(1, 8):
        if step in stalls:
            lines.append(
                {"event": "save", "step": step, "mode": "async", "stall_s": stalls[step][0]}
            )
        own = stalls.get(step, (0.0,))[0]
        after = stalls.get(step - 1, (0.0, 0.0005))[1]
        stall = own or after
        lines.append({"step": step, "loss": 1.0, "lr": 1e-3, "checkpoint_stall_s": stall})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc = cli("report", str(tmp_path), "-o", str(tmp_path / "r.html"))
    assert proc.returncode == 0, proc.stderr
    page = html.unescape((tmp_path / "r.html").read_text())
    assert (
        "median 0.042s, max 0.052s over 2; left out: the saves at steps 2 (a process's first"
        in page
    )
    assert "<td>2.0</td>" in page.replace(' class="num"', "")  # step 5's wait, in ms
