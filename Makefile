# dlrover-core developer entry points. `make demo` and `make test` set everything up first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PLUGINS := $(patsubst %/pyproject.toml,%,$(wildcard plugins/*/pyproject.toml))
STAMP := $(VENV)/.dlrover-setup

.PHONY: setup demo test bench bench-tables lint clean

setup: $(STAMP)

# torch is pinned to the CPU wheel that lies on this kind of machine (see docs); an
# unpinned torch would download a multi-GB CUDA build.
$(STAMP): pyproject.toml $(wildcard plugins/*/pyproject.toml) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 numpy
	$(PY) -m pip install --quiet -e '.[test,plot]' $(foreach p,$(PLUGINS),-e '$(p)[test]')
	touch $(STAMP)

demo: setup
	$(PY) examples/charlm/run.py --steps 300 --chaos --result-json results/demo.json --plot results/demo.png

test: setup
	$(PY) -m ruff check dlrover_core plugins tests examples
	$(VENV)/bin/lint-imports --no-cache
	$(PY) -m compileall -q dlrover_core plugins  # bytecode once, read by every process (also under PYTHONDONTWRITEBYTECODE)
	$(PY) -m pytest -n 3 --dist loadgroup  # pytest-xdist: three worker processes on the 2 cores (the jobs tests run wait on sleeps and sockets a third of the time); a module marked xdist_group runs on one

lint: setup
	$(PY) -m ruff check dlrover_core plugins tests examples benchmarks

bench: setup
	$(PY) benchmarks/checkpoint.py --quick

# README's benchmark tables from benchmarks/results/*.json, then one PNG per series into docs/
# (the plots need matplotlib: pip install -e '.[bench]'); `benchmarks/tables.py --check` tests the tables
bench-tables: setup
	$(PY) benchmarks/tables.py
	$(PY) benchmarks/tables.py --plots

clean:
	rm -rf $(VENV) dlrover-runs results .pytest_cache
