"""Save planning paid once: a second save of the same shapes runs no global planning."""

import json

import pytest

from conftest import run_script
from dcpkit.engine import planning


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["disabled", "async_with_pinned_mem"])
def test_a_second_save_of_the_same_shapes_plans_nothing(tmp_path, mode):
    if not planning.CACHING:
        pytest.skip("this torch's DCP cannot cache save plans")
    proc = run_script(2, "plan_caching.py", str(tmp_path / "checkpoint"), mode)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    ranks = json.loads(line[len("RESULT ") :])
    # The coordinator planned the first save only; the other rank never plans.
    assert [r["counts"] for r in ranks] == [[1, 1, 1], [0, 0, 0]]
    # The saves that reused the cached plan and metadata load back bitwise.
    assert all(r["bitwise"] for r in ranks)
