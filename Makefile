PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint fuzz venv clean report-check wheel-check

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m dcpkit.demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

fuzz: $(STAMP)
	$(PY) benchmarks/fuzz.py --mutants 5000 --seed 1

# The report rendered by a real headless Chromium (Debian's package; installed here when missing).
report-check: $(STAMP)
	@command -v chromium >/dev/null || { test "$$(id -u)" = 0 && apt-get install -y -q chromium >/dev/null; } \
		|| { echo "report-check needs Chromium: apt-get install chromium" >&2; exit 1; }
	$(PY) -m pytest -q tests/test_ecosystem.py

# A wheel from a clean clone, installed into a fresh venv, run from outside the repository.
wheel-check: $(STAMP)
	bash .ci/wheel-check

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) demo_out .pytest_cache
