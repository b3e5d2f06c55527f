"""What a run leaves for people to look at: metrics events, TensorBoard, plots and the report."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import run_train
from dcpkit.cli import main as cli_main
from dcpkit.train.metrics import read_run

# matplotlib's first two colors: the first and second run of a plot
BLUE, ORANGE = (31, 119, 180), (255, 127, 14)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory) -> Path:
    """1 rank, 8 steps with TensorBoard; a crash after step 6 whose newest checkpoint is step 4
    (step-6 removed), so the resume writes steps 5 and 6 a second time."""
    dump = tmp_path_factory.mktemp("resumed")
    common = (
        "--training.steps",
        "8",
        "--checkpoint.interval",
        "4",
        "--metrics.enable_tensorboard",
        "--metrics.log_freq",
        "2",
    )
    run_train(1, dump, *common, "--training.stop_at_step", "6")
    shutil.rmtree(dump / "checkpoint" / "step-6")
    run_train(1, dump, *common)
    return dump


def test_metrics_record_starts_resumes_and_saves(resumed_run):
    run = read_run(resumed_run)
    assert sorted(run.steps) == list(range(1, 9))
    starts = run.starts()
    assert [(s["world_size"], s["resumed_from"], s["saved_world_size"]) for s in starts] == [
        (1, None, None),
        (1, 4, 1),
    ]
    assert starts[1]["config"]["metrics"]["log_freq"] == 2
    saves = run.saves()
    assert sorted(saves) == [4, 6, 8]
    assert all(e["mode"] == "sync" and e["stall_s"] >= 0 for e in saves.values())
    # the last record of a step written twice is the resumed run's
    lines = (resumed_run / "metrics.jsonl").read_text().splitlines()
    assert sum('"step": 5,' in line and '"loss"' in line for line in lines) == 2


def test_tensorboard_scalars_read_back_without_duplicate_steps(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = resumed_run / "tb"
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # the resume appended to the run
    acc = EventAccumulator(str(tb))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "loss/global_avg",
        "lr",
        "grad_norm",
        "throughput/tokens_per_s",
        "checkpoint/stall_s",
    } <= tags
    run = read_run(resumed_run)
    events = acc.Scalars("loss/global_avg")
    steps = [e.step for e in events]
    # log_freq 2: the first step, every second step, and the checkpoint / last steps
    assert steps == [1, 2, 4, 6, 8]
    assert len(set(steps)) == len(steps)
    for e in events:
        assert e.value == pytest.approx(run.steps[e.step]["loss"], rel=1e-6)
    stalls = {e.step: e.value for e in acc.Scalars("checkpoint/stall_s")}
    assert stalls[4] == pytest.approx(run.steps[4]["checkpoint_stall_s"], rel=1e-5)


def test_wandb_offline_run_continues_after_a_resume(tmp_path):
    dump = tmp_path / "run"
    common = ("--training.steps", "4", "--checkpoint.interval", "2", "--metrics.enable_wandb")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    run_train(1, dump, *common, "--training.stop_at_step", "2", env=env)
    run_train(1, dump, *common, env=env)
    run_id = (dump / "wandb_run_id").read_text()
    runs = sorted((dump / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)
    assert all((r / f"run-{run_id}.wandb").stat().st_size > 0 for r in runs)


def _colour_pixels(image: np.ndarray, colour: tuple[int, int, int], tol: int = 12) -> int:
    rgb = image[..., :3]
    if rgb.dtype != np.uint8:
        rgb = (rgb * 255).round().astype(np.int16)
    return int((np.abs(rgb.astype(np.int16) - np.array(colour)).max(axis=-1) <= tol).sum())


def test_plot_overlays_runs(resumed_run, reference_run, tmp_path):
    import matplotlib.image

    out = tmp_path / "loss.png"
    assert cli_main(["plot", str(reference_run), str(resumed_run), "-o", str(out)]) == 0
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 600 and image.shape[1] > 800
    assert _colour_pixels(image, BLUE) > 500 and _colour_pixels(image, ORANGE) > 500
    assert cli_main(["plot", str(tmp_path / "nothing"), "-o", str(tmp_path / "x.png")]) == 2


def test_report_shows_plot_checkpoints_and_config(resumed_run, reference_run, tmp_path):
    # a flipped byte in step-4 makes it the one checkpoint that fails verification
    damaged = tmp_path / "damaged"
    shutil.copytree(resumed_run, damaged)
    victim = sorted((damaged / "checkpoint" / "step-4").glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    out = tmp_path / "report.html"
    assert cli_main(["report", str(damaged), "-o", str(out), "--compare", str(reference_run)]) == 0
    page = out.read_text()
    assert 'src="data:image/png;base64,' in page
    assert "http://" not in page and "https://" not in page  # nothing to fetch
    assert page.count("<tr><td>step-") == 2
    row4 = page[page.index("<tr><td>step-4") :].split("</tr>")[0]
    row8 = page[page.index("<tr><td>step-8") :].split("</tr>")[0]
    assert "CORRUPT" in row4 and "failed" in row4
    assert "ok</span> (checksums" in row8
    assert "after step 4 on 1 rank(s)" in page
    assert "[metrics]" in page and "enable_tensorboard" in page


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here (make report-check installs it)")
def test_report_renders_in_headless_chromium_with_the_plot_visible(
    resumed_run, reference_run, tmp_path
):
    import matplotlib.image

    out = tmp_path / "report.html"
    assert (
        cli_main(["report", str(resumed_run), "-o", str(out), "--compare", str(reference_run)]) == 0
    )
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1200,1400",
            f"--screenshot={shot}",
            out.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.is_file(), proc.stderr[-2000:]
    image = matplotlib.image.imread(shot)
    # the plot's lines and bars, in both runs' colours, are on screen: the image was rendered
    assert _colour_pixels(image, BLUE) > 2000
    assert _colour_pixels(image, ORANGE) > 500
