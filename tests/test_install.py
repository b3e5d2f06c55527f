"""The README's install lines, run as written: the wheel built from the tree, then installed by
the README's exact ``pip install`` line into fresh virtual environments, with pip as Python 3.11
ships it and with the newest pip; then ``dcpkit --version`` from outside the repository, and
(once: both pips install the same wheel) the README's training loop under torchrun there.

The fresh environments see this test environment's packages (torch and the extras' packages)
through a ``.pth`` line, so that pip finds the dependencies already satisfied instead of
downloading gigabytes: what is tested is that the lines parse and install dcpkit, on both pips.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT, torchrun_env

pytestmark = pytest.mark.dist


def _readme_lines() -> list[str]:
    """The commands of the README's "Installing without the repository" block."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Installing without the repository\n\n```bash\n(.*?)```", text, re.S)
    assert block, "the README lost its install block"
    return [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    lines = _readme_lines()
    build = next(x for x in lines if "-m build" in x)
    assert build.startswith("python -m pip install build && python -m build --wheel"), build
    out = tmp_path_factory.mktemp("wheel")
    clone = out / "clone"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".venv", ".git", "site", "*_out"))
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(clone / "dist"), str(clone)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    wheels = list((clone / "dist").glob("dcpkit-*.whl"))
    assert len(wheels) == 1
    return clone


@pytest.mark.parametrize("pip", ["shipped", "newest"])
def test_the_readme_install_lines_work_as_written(wheel, tmp_path, pip):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    if pip == "newest":
        up = subprocess.run(
            [python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr[-2000:]
    version = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True)
    site = Path(
        subprocess.check_output(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    (site / "_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {**os.environ, "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    install = next(x for x in _readme_lines() if x.startswith("pip install"))
    proc = subprocess.run(
        install, shell=True, cwd=wheel, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, (version.stdout, proc.stdout[-3000:], proc.stderr[-3000:])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = subprocess.run(
        ["dcpkit", "--version"], cwd=elsewhere, env=env, capture_output=True, text=True
    )
    assert shown.returncode == 0 and shown.stdout.startswith("dcpkit 0.1.0"), shown
    where = subprocess.check_output(
        [python, "-c", "import dcpkit; print(dcpkit.__file__)"], cwd=elsewhere, env=env, text=True
    )
    assert where.startswith(str(venv)), where  # the wheel's dcpkit, not the tree's
    if pip == "newest":
        return  # what pip installed is the same wheel's: its training loop runs once, below
    loop = shutil.copy(ROOT / "examples" / "fsdp2_loop.py", elsewhere)
    run_env = {**torchrun_env(), "PATH": env["PATH"]}
    run_env.pop("PYTHONPATH", None)
    trained = subprocess.run(
        [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", loop],
        cwd=elsewhere, env=run_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert any(elsewhere.rglob("step-*")), list(elsewhere.rglob("*"))
