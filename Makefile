# `make run` and `make test` install what is missing into .venv, then do their job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py orchestrator/data/_rows.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that nothing later resolves a CUDA build of it. pip compiles
	# every module here: Ray starts its workers with PYTHONDONTWRITEBYTECODE=1, so a module
	# without its .pyc is compiled again in every worker (--no-compile made the suite crawl).
	$(PY) -m pip install -q --disable-pip-version-check "torch==2.13.0"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m orchestrator $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf outputs multirun checkpoints .pytest_cache
