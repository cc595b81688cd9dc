# gyre-ray: the README's two commands are `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
RUN_CONFIG ?= jobs/configs/toy.yaml
CLAUDE_CODE_VERSION ?= 2.1.197
CLAUDE := .cache/claude/node_modules/.bin/claude

.PHONY: install run test lint format bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The Megatron trainer backend; 0.16.1 is the last release for Python 3.11. Its torch>=2.6 is met by
	# the pin above (torch named again so pip cannot swap it).
	$(PY) -m pip install -q torch==2.13.0 megatron-core==0.16.1
	$(PY) -m pip install -q -e '.[dev,cpu]'
	@# Mooncake's non-CUDA wheel loads only with Debian's libibverbs1 (installed where we are root with apt).
	@if ! ldconfig -p | grep -q 'libibverbs.so.1 '; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			(apt-get update -qq && apt-get install -y -qq libibverbs1 >/dev/null) || test "$$CI" != true; \
		else echo "note: libibverbs1 missing (not root or no apt): Mooncake tests will skip"; fi; \
	fi
	@touch $(STAMP)

install: $(STAMP)

# Claude Code for its headless test (tests skip it, saying why, when npm or the package is missing).
$(CLAUDE):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .cache/claude @anthropic-ai/claude-code@$(CLAUDE_CODE_VERSION) \
		|| echo "warning: Claude Code install failed; its test will be skipped"; \
	else echo "warning: npm not found; the Claude Code test will be skipped"; fi

run: install
	$(VENV)/bin/gyre-ray train --config $(RUN_CONFIG)

test: install $(CLAUDE)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -m "not gpu" --timeout=600

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
