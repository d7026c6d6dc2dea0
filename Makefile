# `make run` and `make test` install what is missing into .venv, then do their job.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The torch CPU wheel this machine kind has (docs/testing.md).
TORCH ?= 2.13.0

.PHONY: run test lint install clean smoke

install: $(STAMP)

$(STAMP): pyproject.toml setup.py orchestrator/data/_rows.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned, so that nothing later resolves a CUDA build of it. pip compiles
	# every module here: Ray starts its workers with PYTHONDONTWRITEBYTECODE=1, so a module
	# without its .pyc is compiled again in every worker (--no-compile made the suite crawl).
	$(PY) -m pip install -q --disable-pip-version-check "torch==$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m orchestrator $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

# The smoke subset on the oldest Ray of the tested range (pyproject.toml), in an environment of
# its own: the private hooks checked against it, the default job, DDP and FSDP, a torchrun
# script, a sweep, killed and interrupted runs, a preemption notice (docs/testing.md).
# SMOKE_TORCH picks the torch of that environment: `make smoke SMOKE_RAY=2.60.0
# SMOKE_TORCH=2.14.1` checks a newer torch than `make test`'s (PyPI's build, with CUDA
# libraries it runs without on a machine with no GPU).
SMOKE_RAY ?= 2.58.0
SMOKE_TORCH ?= $(TORCH)
SMOKE_VENV ?= .venv-ray$(SMOKE_RAY)$(if $(filter-out $(TORCH),$(SMOKE_TORCH)),-torch$(SMOKE_TORCH))
SMOKE_TESTS ?= tests/test_ray_internals.py tests/test_observe.py tests/test_ddp_e2e.py \
	tests/test_script_e2e.py tests/test_pytorch_trainer.py \
	"tests/test_sweep.py::test_a_parallelism_sweep_runs_each_trial_and_writes_the_scaling_report" \
	"tests/test_preemption.py::test_ray_drain_node_with_reason_preemption_saves_a_users_own_loop_and_script_at_the_notice"

smoke:
	test -x $(SMOKE_VENV)/bin/python || $(PYTHON) -m venv $(SMOKE_VENV)
	$(SMOKE_VENV)/bin/python -m pip install -q --disable-pip-version-check "torch==$(SMOKE_TORCH)"
	$(SMOKE_VENV)/bin/python -m pip install -q --disable-pip-version-check -e ".[test]" \
		"ray[train,default]==$(SMOKE_RAY)"
	$(SMOKE_VENV)/bin/python -c "import ray, torch; assert ray.__version__ == '$(SMOKE_RAY)', ray.__version__; \
		assert torch.__version__.split('+')[0] == '$(SMOKE_TORCH)', torch.__version__"
	$(SMOKE_VENV)/bin/python -m pytest $(SMOKE_TESTS) $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf outputs multirun checkpoints .pytest_cache
