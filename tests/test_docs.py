"""The README and the docs site cannot drift from the code: the README stays short with the two
commands first, every Python block is an example that runs (or a sketch that says so with
``...``), the site builds in strict mode, and headless Chromium renders its pages with every
page in the navigation."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli, run_ranks, torchrun_env

DOCS = sorted((ROOT / "docs").glob("*.md"))
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
SNIPPET = re.compile(r'^--8<-- "(examples/[\w./-]+\.py)"$')


def _blocks(path: Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", path.read_text(), re.S | re.M)


def _body(example: Path) -> str:
    """An example without its module docstring: what a page shows of it."""
    text = example.read_text()
    return text.split('"""\n\n', 1)[1] if text.startswith('"""') else text


def test_the_readme_is_short_and_starts_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    first = _blocks(ROOT / "README.md", "bash")[0]
    assert first.startswith("make demo") and "\nmake test" in first
    for page in re.findall(r"\]\(docs/([\w-]+\.md)", readme):
        assert (ROOT / "docs" / page).is_file(), page
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", readme))
    assert linked == {p.name for p in DOCS}  # a link to every page


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_every_python_block_is_an_example_or_a_sketch(page):
    examples = {_body(e): e for e in EXAMPLES}
    for block in _blocks(page, "python"):
        include = SNIPPET.match(block.strip())
        if include:
            assert (ROOT / include.group(1)).is_file(), include.group(1)
        elif "..." not in block:  # runnable as shown: then it is an example, word for word
            assert block in examples, f"{page.name}: a runnable block that is no example"


def test_every_example_is_shown_somewhere():
    shown = "".join(p.read_text() for p in [ROOT / "README.md", *DOCS])
    for example in EXAMPLES:
        rel = example.relative_to(ROOT).as_posix()
        assert f'--8<-- "{rel}"' in shown or _body(example) in shown, rel


def _run_example(cwd: Path, name: str) -> dict[int, str]:
    proc = run_ranks(2, ROOT / "examples" / name, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {int(m[0]): m[1] for m in re.findall(r"^step (\d+) loss (\S+)$", proc.stdout, re.M)}


@pytest.mark.dist
def test_the_fsdp2_example_runs_and_resumes_bitwise(tmp_path):
    full = _run_example(tmp_path, "fsdp2_loop.py")
    assert sorted(full) == list(range(1, 31))
    folder = tmp_path / "outputs" / "fsdp2" / "checkpoint"
    assert (folder / "step-30").is_dir()
    assert _run_example(tmp_path, "fsdp2_loop.py") == {}  # finished: it resumes after step 30
    for step in (20, 30):  # as if it had been stopped after step 10
        shutil.rmtree(folder / f"step-{step}")
    again = _run_example(tmp_path, "fsdp2_loop.py")
    assert sorted(again) == list(range(11, 31))
    assert all(again[s] == full[s] for s in again), "the resumed losses differ"
    assert cli("verify", str(folder / "step-30")).returncode == 0


def _build(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**torchrun_env(), "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WARNING" not in proc.stderr, proc.stderr[-3000:]
    return site


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        if path := shutil.which(name):
            return path
    return None


def _navigation(site: Path) -> list[str]:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return [next(iter(entry)) for entry in nav]


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here (make test installs it as root)")
@pytest.mark.parametrize("page", ["", "library/"], ids=["home", "library"])
def test_the_site_renders_in_headless_chromium_with_every_page_in_its_navigation(tmp_path, page):
    import numpy as np
    from PIL import Image

    site = _build(tmp_path)
    url = (site / page / "index.html").as_uri()
    base = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    shot = tmp_path / "shot.png"
    proc = subprocess.run(
        [*base, "--window-size=1400,1000", f"--screenshot={shot}", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert shot.is_file(), proc.stderr[-2000:]
    pixels = np.asarray(Image.open(shot).convert("L"), dtype=np.float32)
    dark = (pixels < 100).mean()  # text and the header bar are on screen, not a blank page
    assert 0.005 < dark < 0.6 and pixels.std() > 20, (dark, pixels.std())
    dom = subprocess.run(
        [*base, "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    titles = re.findall(r'<a href="[^"]*" class="md-nav__link[^"]*">\s*<span class="md-ellipsis">'
                        r"\s*(.*?)\s*</span>", dom, re.S)  # fmt: skip
    for title in _navigation(site):
        assert title in titles, (title, titles)
    heading = "dcpkit" if page == "" else "The library"
    assert f">{heading}" in dom


_MEASURE = """<html><body><pre id="out">pending</pre><script>
const pages = %s;
for (const page of pages) {
  const f = document.createElement("iframe");
  f.width = 1280;
  f.height = 800;
  f.src = page;
  document.body.appendChild(f);
}
window.onload = () => {  // every frame has loaded
  const found = {};
  document.querySelectorAll("iframe").forEach((f, i) => {
    const d = f.contentDocument, bad = [];
    const boxes = ".md-typeset pre > code, .md-typeset table, .md-typeset__scrollwrap";
    for (const el of d.querySelectorAll(boxes))
      if (el.scrollWidth > el.clientWidth + 1) bad.push("cut: " + el.textContent.slice(0, 60));
    for (const el of d.querySelectorAll(".md-typeset table code"))
      if (el.getClientRects().length > 1) bad.push("wrapped: " + el.textContent);
    found[pages[i]] = bad;
  });
  document.getElementById("out").textContent = "MEASURED" + JSON.stringify(found);
};
</script></body></html>"""


@pytest.mark.skipif(_chromium() is None, reason="no Chromium here (make test installs it as root)")
def test_code_and_tables_fit_a_laptop_screen(tmp_path):
    """Every page at 1280 pixels, measured in the browser (one browser, each page in a frame of
    that width): no code block or table wider than its column (a line cut off behind a scroll
    bar), no name in a table broken across lines."""
    site = _build(tmp_path)
    names = {  # the generated API reference is left out: signatures
        page.as_uri(): str(page.relative_to(site))
        for page in sorted(site.glob("**/index.html"))
        if page.parent.name not in ("api", "404")
    }
    pages = list(names)
    harness = tmp_path / "measure.html"
    harness.write_text(_MEASURE % json.dumps(pages))
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom",
           "--allow-file-access-from-files", "--virtual-time-budget=10000"]  # fmt: skip
    cmd.append(harness.as_uri())
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=90).stdout
    found = re.search(r"MEASURED(\{.*?\})</pre>", dom, re.S)
    assert found, dom[-1000:]
    measured = json.loads(html.unescape(found.group(1)))
    assert sorted(measured) == sorted(pages)  # every page was loaded and measured
    problems = {names[page]: bad for page, bad in measured.items() if bad}
    assert problems == {}


def test_the_options_table_lists_every_option():
    """docs/library.md's options table has a row for every ``CheckpointConfig`` field (the
    README sends readers there for "every option")."""
    import dataclasses

    from dcpkit import CheckpointConfig

    text = (ROOT / "docs" / "library.md").read_text()
    rows = set(re.findall(r"^\| `([a-z_]+)` \|", text, re.M))
    fields = {f.name for f in dataclasses.fields(CheckpointConfig) if f.init}
    assert fields - rows == set(), sorted(fields - rows)


@pytest.mark.dist
def test_the_local_s3_page_runs_as_written(tmp_path):
    """docs/s3-local.md's session, line by line (all but its install line, which
    test_install.py covers; on a free port): SeaweedFS started, a bucket made, the trainer
    saving to s3://, `dcpkit list` and `dcpkit verify` reading it in place, the server stopped."""
    from conftest import free_port, port_free

    text = (ROOT / "docs" / "s3-local.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block
    lines = [x for x in block.group(1).splitlines() if not x.startswith("pip install")]
    # SeaweedFS listens for gRPC on the S3 port + 10000: both must be valid and free
    port = str(next(p for p in iter(free_port, 0) if p + 10000 <= 65535 and port_free(p + 10000)))
    script = "\n".join(lines).replace("8333", port) + "\n"  # each line's outcome is read below
    env = torchrun_env({"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        env.pop(key, None)
    try:
        proc = subprocess.run(
            ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
    finally:  # the page's `kill` asks the server to stop; it may take its time
        subprocess.run(["pkill", "-9", "-f", f"s3.port={port}"], check=False)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "error" not in out.lower(), out[-4000:]
    assert "step-4" in out and "published" in out, out[-3000:]
    assert "OK: s3://demo/run/checkpoint/step-4" in out, out[-3000:]
