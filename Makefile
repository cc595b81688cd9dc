# gyre-ray: the README's two commands are `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
RUN_CONFIG ?= jobs/configs/learn.yaml
# The real harnesses' versions: pinned here and nowhere else (their tests check the installed ones).
CLAUDE_CODE_VERSION ?= 2.1.197
CODEX_VERSION ?= 0.171.0
CLAUDE_STAMP := .cache/claude/.installed-$(CLAUDE_CODE_VERSION)
CODEX_STAMP := .cache/codex/.installed-$(CODEX_VERSION)
# `make test` runs the suite in this many pytest-xdist workers, a test file per worker at a time
# (a module's shared Ray / job fixture runs once): many tests wait on Ray start-up, agents and servers.
TEST_WORKERS ?= 2

.PHONY: install install-harnesses run test test-extended test-long lint format bench clean

$(STAMP): pyproject.toml Makefile constraints.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	# The Megatron trainer backend; 0.16.1 is the last release for Python 3.11. Its torch>=2.6 is met by
	# the pin above (torch named again so pip cannot swap it).
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0 megatron-core==0.16.1
	# Every other package at the version in constraints.txt (a clean-clone CI passed with that set).
	$(PY) -m pip install -q -c constraints.txt -e '.[dev,cpu]'
	@# Mooncake's non-CUDA wheel loads only with Debian's libibverbs1 (installed where we are root with apt).
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			(apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null) || test "$$CI" != true; \
		else echo "note: libibverbs1 missing (not root or no apt): Mooncake tests will skip"; fi; \
	fi
	@# The torch engine's native CPU GEMM is compiled on first use with the system C compiler (without
	@# one it falls back to torch's kernels; under CI its tests must run, so gcc is installed where we can).
	@if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			(apt-get update -qq && apt-get install -y -qq gcc >/dev/null) || test "$$CI" != true; \
		else echo "note: no C compiler (not root or no apt): the native GEMM tests will skip"; fi; \
	fi
	@touch $(STAMP)

install: $(STAMP)

# Claude Code and Codex (npm; each ships a native binary) into the ignored .cache/, for agents.harness
# claude-code / codex and their tests. Under CI a failed install fails the build (their tests must run);
# elsewhere it warns and those tests skip, saying why.
define npm_install
	@mkdir -p $(dir $(1))
	@if command -v npm >/dev/null 2>&1 && npm install --silent --no-audit --no-fund --prefix $(dir $(1)) $(2); then \
		touch $(1); \
	elif [ "$$CI" = "true" ]; then echo "error: npm install $(2) failed" >&2; exit 1; \
	else echo "warning: npm install $(2) failed (or npm is missing); its tests will be skipped"; fi
endef

$(CLAUDE_STAMP):
	$(call npm_install,$@,@anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION))

$(CODEX_STAMP):
	$(call npm_install,$@,@openai/codex@$(CODEX_VERSION))

install-harnesses: $(CLAUDE_STAMP) $(CODEX_STAMP)

run: install
	$(VENV)/bin/gyre-ray train --config $(RUN_CONFIG)

# --durations=20: the 20 slowest tests are named at the end (the suite is kept to about 15 minutes).
test: install install-harnesses
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -m "not gpu and not long and not extended" --timeout=600 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=20

# The tests marked `extended` (which ones: README, "Development"), left out of `make test` to keep it near
# 15 minutes on 2 cores.
test-extended: install install-harnesses
	$(PY) -m pytest -q -m "extended and not gpu" --timeout=1200 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=10

# The learning runs (tests/test_learning_long.py: 2 seeds and an lr=0 control of the default job), minutes each.
# Its own temp root: another pytest starting meanwhile resets /tmp/pytest-of-<user> to mode 0700, which
# locks the sandboxed harness uids out of the run folders under it (a whole step's executions fail).
test-long: install
	@mkdir -p .cache
	$(PY) -m pytest -q -s -m long --timeout=3600 --basetemp=$(CURDIR)/.cache/test-long tests/test_learning_long.py

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: install
	$(PY) benchmarks/bench_engine.py
	$(PY) benchmarks/bench_trajectory.py
	$(PY) benchmarks/bench_sim.py

clean:
	rm -rf $(VENV) runs .pytest_cache .cache
