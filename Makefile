# gyre-ray: the README's two commands are `make run` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
RUN_CONFIG ?= jobs/configs/toy.yaml

.PHONY: install run test lint format bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Pinned first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

run: install
	$(VENV)/bin/gyre-ray train --config $(RUN_CONFIG)

test: install
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
	rm -rf $(VENV) runs .pytest_cache
