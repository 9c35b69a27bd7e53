# `make run` and `make test` do all set-up on a fresh machine: they create .venv and install.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-fast bench bytecode clean

$(STAMP): pyproject.toml setup.py cachemw/_blocktrace.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip setuptools wheel
	# torch 2.13.0 CPU build from local disk; plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

# An editable install leaves cachemw's bytecode to the first import, which does not write it
# where PYTHONDONTWRITEBYTECODE is set: every process (each DataLoader worker, each daemon)
# would compile the package again, ~0.1 s each. Written here (under a second), checked
# against each source's hash at import, so an edited file is never run from old bytecode.
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -f -j 0 --invalidation-mode checked-hash cachemw placement checkpoint

run: bytecode
	$(BIN)/cachemw job

test: bytecode
	$(BIN)/pytest --durations=30

test-fast: bytecode
	$(BIN)/pytest -m "not slow and not multinode and not slurm"

bench: bytecode
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache cachemw/*.so
