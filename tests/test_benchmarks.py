"""The conversion benchmark runs end to end and measures what it claims (small size)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_convert_benchmark_small(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "convert.py"),
            "--gb",
            "0.3",  # one size: the RSS rule holds at each (the size sweep is the benchmark's)
            "--json",
            str(out),
            "--workdir",
            str(tmp_path),
            "--settle",
            "0",  # host_memory's test covers the wait
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (data,) = json.loads(out.read_text())["sizes"]
    results = data["results"]
    assert set(results) >= {
        "raw read+write",
        "dcpkit to-torch",
        "dcpkit to-hf",
        "dcpkit from-hf",
        "torch dcp_to_torch_save",
    }
    assert data["checkpoint_bytes"] > 0.5 * (1 << 30)
    # PyTorch's consolidation holds the whole checkpoint; the streaming ones do not.
    ref = results["torch dcp_to_torch_save"]["rss_above_baseline_bytes"]
    for name in ("dcpkit to-torch", "dcpkit to-hf", "dcpkit from-hf"):
        assert results[name]["rss_above_baseline_bytes"] < 0.75 * ref, name
    assert proc.stdout.count("x raw") == 1
    assert f"wrote {out.with_suffix('.png')}" in proc.stdout
    import matplotlib.image

    assert matplotlib.image.imread(out.with_suffix(".png")).shape[1] > 0


def test_moe_convert_benchmark_small(tmp_path):
    out = tmp_path / "moe.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "moe_convert.py"), "--small"]
    cmd += ["--experts", "8", "--vocab", "4096", "--json", str(out), "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    results = data["results"]
    assert set(results) >= {"raw read+write", "dcpkit to-hf", "dcpkit from-hf"}
    assert "dcpkit from-hf (FP8 source)" in results
    assert data["fp8_folder_bytes"] < data["checkpoint_bytes"]  # FP8 weights: fewer bytes
    for name in ("dcpkit to-hf", "dcpkit from-hf", "dcpkit from-hf (FP8 source)"):
        assert results[name]["wall_s"] > 0
        assert results[name]["rss_above_baseline_bytes"] < data["rss_bound_bytes"], name


@pytest.mark.alone
def test_train_cost_benchmark_small(tmp_path):
    out = tmp_path / "cost.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_cost.py"), "--steps", "6"]
    cmd += ["--interval", "2", "--modes", "async", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    r = data["results"]["async"]
    # Measured from the runs' own step records: two saves in steps 2-5, each blocking a while.
    assert set(data["step_times"]) == {"baseline", "async", "baseline_again"}
    assert len(data["step_times"]["async"]) == 4
    assert 0 < r["blocked_per_save_s"] < r["saving_step_s"]
    assert data["copy_floor_s"] > 0 and data["state_bytes_per_rank"] > 1 << 20
    assert "true cost/save" in proc.stdout


def test_model_io_benchmark_small(tmp_path):
    out = tmp_path / "model_io.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "model_io.py"), "--flavor", "debugmodel"]
    cmd += ["--dtype", "float32", "--nproc", "1", "2", "--json", str(out)]
    cmd += ["--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"1", "2"}
    for nproc, run in data["runs"].items():
        s = run["slowest"]
        for key in ("load_s", "raw_read_s", "save_s", "raw_write_fsync_s"):
            assert s[key] > 0, (nproc, key)
        # Every rank saved its shard of the model and the load filled the model.
        assert sum(r["rank_bytes"] for r in run["ranks"]) >= 0.9 * data["checkpoint_bytes"]
        assert s["saved_bytes"] >= 0.9 * data["checkpoint_bytes"]
    assert "x baseline speed" in proc.stdout


def test_io_speed_benchmark_small(tmp_path):
    """The IO benchmark at a toy size: every operation and both floors measured at 1 and 2
    ranks, beside their raw baselines, the state as large as asked; the throughput plot written
    next to the JSON, a panel per world size (the size sweep is the benchmark's)."""
    out = tmp_path / "io_speed.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "io_speed.py"), "--gb", "0.1"]
    cmd += ["--dim", "128", "--nproc", "1", "2", "--reps", "1", "--json", str(out)]
    cmd += ["--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["gb"], r["nproc"]) for r in runs) == [(0.1, 1), (0.1, 2)]
    for run in runs:
        s, where = run["slowest"], (run["gb"], run["nproc"])
        for key in ("save_s", "raw_write_fsync_s", "load_warm_s", "load_verify_cold_s"):
            assert s[key] > 0, (where, key)
        for key in ("raw_read_warm_s", "raw_read_hashed_warm_s", "dcp_floor_warm_s"):
            assert s[key] > 0, (where, key)
        assert sum(r["rank_bytes"] for r in run["ranks"]) >= 0.9 * run["checkpoint_bytes"]
        # CPU time of every thread, summed over the ranks, and the hash's alone.
        cpu = run["cpu"]
        assert cpu["load_warm_cpu"] > 0 and cpu["xxh3_only_cpu"] > 0, where
        # The least verify-on-load can cost: the hash's CPU the cores' idle time cannot absorb.
        capacity = (os.cpu_count() or 1) * s["load_warm_s"]
        floor = max(0.0, cpu["xxh3_only_cpu"] - max(0.0, capacity - cpu["load_warm_cpu"]))
        assert run["verify_floor"] == pytest.approx(floor / capacity), where
    for run in runs:  # the size asked for, within a few percent
        assert run["checkpoint_bytes"] == pytest.approx(0.1 * 2**30, rel=0.05), run["nproc"]
    assert proc.stdout.count("DCP's own steps of a load") == 2
    assert proc.stdout.count("hashing every byte as it lands") == 2
    assert proc.stdout.count("CPU time, every thread of all ranks, warm: load ") == 2
    assert proc.stdout.count("even with every idle cycle hashing") == 2
    png = out.with_suffix(".png")
    assert f"wrote {png}" in proc.stdout
    import matplotlib.image

    height, width = matplotlib.image.imread(png).shape[:2]
    assert width > 1.8 * height  # two panels side by side: 1 rank, 2 ranks
    table = _figures("_figures_io").io_speed(json.loads(out.read_text()))
    assert table.splitlines()[0].count(" rank") == 2  # a column per run
    assert "Medians of 1, slowest rank." in table and "goal" not in table  # under 4 GiB


def _figures(module: str):  # type: ignore[no-untyped-def]
    """A renderer module of benchmarks/figures.py (the benchmarks' folder on sys.path)."""
    import importlib

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_recovery_benchmark_small(tmp_path):
    """The recovery benchmark at a toy size without the S3 tier: restores from the memory tier
    and from the durable tier (warm, dropped), the memory-tier stall beside its copy floor,
    and the page's table rendered from its results."""
    out = tmp_path / "recovery.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "recovery.py"), "--gb", "0.05", "--no-s3"]
    cmd += ["--dim", "256"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["command"].startswith("python benchmarks/recovery.py --gb 0.05")
    for key in ("memory_load_s", "disk_warm_load_s", "disk_cold_load_s", "durable_save_s"):
        assert data["slowest"][key] > 0, key
    assert data["slowest"]["memory_save_stall_s"] > 0 and data["slowest"]["copy_floor_s"] > 0
    assert data["ranks"][0]["memory_step"] == 15 and data["ranks"][0]["disk_step"] == 10
    table = _figures("_figures_io").recovery(data)
    assert "| memory tier (`/dev/shm`, peer replicas) | 15 |" in table
    assert "| durable, local disk, page cache dropped (`posix_fadvise`) | 10 |" in table
    assert "S3" not in table and "A memory-tier save blocked" in table


@pytest.mark.alone
def test_host_memory_benchmark_small(tmp_path):
    # Writes right after a deletion and after the host took the freed memory back, each timed;
    # where the machine reports free pages to a host, how much it took is measured too.
    out = tmp_path / "host.json"
    script = ROOT / "benchmarks" / "host_memory.py"
    cmd = [sys.executable, str(script), "--gb", "0.25", "--reps", "1", "--json", str(out)]
    proc = subprocess.run(
        [*cmd, "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["gib"] == 0.25
    assert data["after_delete_s"] > 0 and data["after_settle_s"] > 0
    reporting = Path("/sys/module/page_reporting/parameters/reported_kib").exists()
    assert (data["host_took_mib"] is not None) == reporting
    assert "right after deleting as many bytes" in proc.stdout
    assert list(tmp_path.iterdir()) == [out]  # its scratch file is gone


@pytest.mark.parametrize(
    "script,own", [("trainer_stall", "trainer"), ("lightning_stall", "lightning")]
)
def test_stall_benchmark_small_and_its_docs_table(script, own, tmp_path):
    """The stall benchmarks, the transformers Trainer's (one process per mode) and Lightning's
    under FSDP2 (2 processes, one torchrun), run the framework's own save and every dcpkit mode
    (small size) and write what they printed; the Frameworks page's table is the committed
    results file's figures."""
    out = tmp_path / "stall.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--dim", "128"]
    cmd += ["--layers", "2", "--vocab", "512", "--steps", "10", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    small = json.loads(out.read_text())["results"]
    assert list(small) == [own, "disabled", "async", "async_with_pinned_mem"]
    for r in small.values():
        assert len(r["stalls_s"]) == 2 and r["step_s"] > 0 and r["bytes_on_disk"] > 1 << 20
        assert f"{r['stall_s']:.2f} s" in proc.stdout
        assert own == "trainer" or r["save_call_s"] > 0
    committed = json.loads((ROOT / "benchmarks" / "results" / f"{script}.json").read_text())
    page = (ROOT / "docs" / "integrations.md").read_text()
    names = {"trainer": "the `Trainer`'s own save"}
    for mode, r in committed["results"].items():
        if own == "trainer":
            row = (f"| {names.get(mode, f'dcpkit `{mode}`')} | {r['stall_s']:.2f} s | "
                   f"{r['step_s']:.2f} s | {r['total_s']:.1f} s |")  # fmt: skip
        else:
            row = f"| {r['stall_s']:.2f} s | {r['save_call_s']:.2f} s | {r['step_s']:.2f} s |"
        assert row in page, row


def test_frozen_base_benchmark_and_its_docs_table(tmp_path):
    """A LoRA fine-tune's saves at the benchmark's own size: with the base linked, each later
    save writes at most 1.1x the trainable state's bytes (adapters and AdamW's moments);
    without, at least the base's bytes; the first save writes everything either way. The
    library page's table is the committed results file's figures."""
    out = tmp_path / "frozen.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "frozen_base.py"), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    linked, written = (json.loads(out.read_text())["results"][k] for k in ("linked", "written"))
    assert linked["save_bytes"] <= 1.1 * linked["trainable_state_bytes"], linked
    assert written["save_bytes"] >= written["frozen_bytes"] + written["trainable_state_bytes"]
    assert linked["first_save_bytes"] >= linked["frozen_bytes"] + linked["trainable_state_bytes"]
    assert f"{linked['save_bytes'] / 2**20:.2f} MiB" in proc.stdout
    committed = json.loads((ROOT / "benchmarks" / "results" / "frozen_base.json").read_text())
    page = (ROOT / "docs" / "library.md").read_text()
    for r in committed["results"].values():
        ratio = r["save_bytes"] / r["trainable_state_bytes"]
        assert f"| {r['save_bytes'] / 2**20:.2f} MiB | {ratio:.2f}x | {r['save_s']:.3f} s |" in page


def test_the_pages_figures_come_from_their_results_files():
    """Every marked figures block of README.md and docs/*.md is what its results file gives
    (``benchmarks/figures.py``); one digit changed fails the check, naming the block; each
    source names a script that exists and a results file in the tree."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import figures
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "figures.py"), "--check"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shown = {
        m.group(2) for page in figures.pages() for m in figures.BLOCK.finditer(page.read_text())
    }
    assert shown == set(figures.SOURCES)  # every source shown, every block sourced
    for source in figures.SOURCES.values():
        assert (ROOT / source.script).is_file() and (ROOT / source.results).is_file()
    text = (ROOT / "docs" / "scale.md").read_text()
    assert "| 1095 s, peak 2.71 GiB |" in text
    problems = figures.check_text(text.replace("| 1095 s,", "| 1096 s,"), "docs/scale.md")
    assert len(problems) == 1 and "'metadata_verify' differs" in problems[0], problems
    text = (ROOT / "docs" / "integrations.md").read_text()
    problems = figures.check_text(text.replace("| 2.00 s |", "| 2.01 s |"), "integrations.md")
    assert len(problems) == 1 and "'trainer_stall'" in problems[0], problems
    for page in figures.pages():  # in every block of every page, one digit changed is caught
        text = page.read_text()
        for m in figures.BLOCK.finditer(text):
            digit = re.search(r"\d", m.group(3))
            assert digit, f"{page.name}: block {m.group(2)!r} shows no figure"
            at = m.start(3) + digit.start()
            changed = text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1 :]
            problems = figures.check_text(changed, page.name)
            assert len(problems) == 1 and f"{m.group(2)!r}" in problems[0], problems


MEASURED = re.compile(r"(?<![\w.])\d+(?:\.\d+)?\s?(?:s|ms|GiB/s|GiB|MiB|KiB|x)(?![\w/])|[+-]\d+%")


def test_no_table_shows_a_measured_figure_outside_a_generated_block():
    """A table row of README.md or docs/*.md that shows a time, a size, a ratio or a relative
    cost is inside a figures block (so it comes from a results file); the check itself catches
    such a row."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import figures
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def loose(text: str) -> list[str]:
        outside = figures.BLOCK.sub("", text)
        return [
            line for line in outside.splitlines() if line.startswith("|") and MEASURED.search(line)
        ]

    for page in figures.pages():
        assert loose(page.read_text()) == [], page.name
    assert loose("| restore from | seconds |\n|---|---|\n| memory tier | 0.17 s |\n") != []
    assert loose("| x raw | 1 rank |\n|---|---|\n| load + verify | +12% |\n") != []
    assert loose("| option | default |\n|---|---|\n| `interval` | 500 |\n") == []


# A figure a sentence measured: a decimal time or size, a speed, a ratio, a relative cost, or an
# approximate one ("about 128 MiB"). Settings and limits (a 256 MiB budget, a 60 s expiry) are
# whole numbers and stay.
MEASURED_PROSE = re.compile(
    r"(?<![\w.])\d+\.\d+\s?(?:s|ms|us|µs|TiB|GiB|MiB|KiB|GB|MB)(?![\w/])"
    r"|(?<![\w.])\d+(?:\.\d+)?\s?(?:GiB|MiB|GB|MB)/s\b"
    r"|(?<![\w.])\d+(?:\.\d+)?x(?!\w)"
    r"|(?<![\w.])[+-]\d+(?:\.\d+)?%"
    r"|(?:~|\babout |\baround )\d+(?:\.\d+)?\s?(?:s|ms|us|TiB|GiB|MiB|KiB|GB|MB)\b"
)


def _prose(text: str) -> list[str]:
    """The lines of a Markdown page a reader takes as sentences: not a table row, not code
    (fenced, indented, or inline, which may run over a line's end)."""
    kept, fenced, previous = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("|"):
            indented = line.startswith("    ") and (previous == "" or previous.startswith("    "))
            if not indented:
                kept.append(line)
        previous = line if not fenced else previous
    return re.sub(r"`[^`]*`", "``", "\n".join(kept)).splitlines()


def test_no_page_states_a_measured_figure_outside_a_generated_block():
    """A sentence of README.md or docs/*.md that gives a measured figure (a time or size with
    decimals, a speed, a ratio, a relative cost, an approximate amount) is inside a figures
    block, so it comes from a results file; the check itself catches such a sentence."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import figures
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def loose(text: str) -> list[str]:
        return [line for line in _prose(figures.BLOCK.sub("", text)) if MEASURED_PROSE.search(line)]

    found = {page.name: loose(page.read_text()) for page in figures.pages()}
    assert {name: lines for name, lines in found.items() if lines} == {}
    for sentence in (
        "A plain load is 0.50 s of CPU.",
        "Uploads ran at 0.21 GiB/s both ways.",
        "the host takes about 128 MiB every 2 s",
        "reading 1.00x of the stored bytes",
        "+12% over a plain read",
        "(a checkpoint of 0.84 GiB with AdamW's state)",
    ):
        assert loose(sentence + "\n") == [sentence], sentence
    for sentence in (
        "retried for `storage_retry_s` (default 120 s)",
        "a block of at most 256 MiB",
        "`checkpoint: saved step 500 in 0.41s`",
        "```\nsaved 1.23 GiB in 0.5 s\n```",
        "\n    checkpoint: read 71.8 MiB from storage (1.00x)",
    ):
        assert loose(sentence + "\n") == [], sentence


def test_no_shipped_config_comment_states_a_measured_figure():
    """A config's comments say what it is for, never how long it takes: a time there is a
    figure no results file backs (the shipped and the repository's configs alike)."""
    duration = re.compile(r"\b(seconds?|minutes?|hours?|fast|quick)\b", re.I)
    configs = [*(ROOT / "configs").glob("*.toml")]
    configs += (ROOT / "src" / "dcpkit" / "train" / "configs").glob("*.toml")
    assert len(configs) >= 6
    for path in configs:
        for line in path.read_text().splitlines():
            comment = line.partition("#")[2]
            assert not MEASURED.search(comment) and not duration.search(comment), (path, line)
    assert duration.search("# 2 ranks, a few seconds per 10 steps")


def test_a_generated_paragraph_never_wraps_into_a_list_or_a_table():
    """Generated sentences are wrapped for the page; a line may not begin with '+12%', '-3%',
    '* ', '| ' or '1.', which Markdown would render as a bullet, a table row or a list."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from _format import para
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for shift in range(40):
        text = "word " * shift + "costs +12% warm and -3% cold, 1. then | and * also > here " * 6
        lines = para(text).splitlines()
        assert " ".join(lines).split() == text.split()
        assert all(len(line) <= 96 for line in lines)
        assert not any(re.match(r"([-+*>|#]|\d+\.)\s", line) for line in lines[1:]), lines
