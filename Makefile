# Two commands from a fresh clone: `make train` (the main job) and `make test`.
# The virtual environment lives outside the clone, keyed by the dependency pins, and is created
# on first use (~2-3 min, ~6 GB: torch 2.14.1 is a CUDA build that also runs on CPU).
PYTHON ?= python3
DEPS_HASH := $(shell sed -n '/^dependencies/,/^]/p;/^dev = /p' pyproject.toml | sha256sum | cut -c1-12)
VENV ?= $(HOME)/.cache/titan-lrattnres/venv-$(DEPS_HASH)
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export PYTHONPATH := $(CURDIR)

.PHONY: venv train test lint test-fast bench clean-venv env gpu-rehearsal

venv: $(VENV)/.installed

$(VENV)/.installed:
	mkdir -p $(dir $(VENV))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

# The main job (see README): trains cpu_default on the embedded corpus.
CONFIG ?= cpu_default
train: venv
	$(PY) -m titan_lrattnres.train $(CONFIG)

# The embedded corpus + tokenizer (make train builds them when missing; this forces nothing).
.PHONY: data
data: venv
	$(PY) -m titan_lrattnres.data build

lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Main suite, then the Triton kernels under the interpreter in their own process.
# Any non-zero pytest exit fails the target, 5 (no test collected) included.
# TEST_WORKERS pytest-xdist workers, each taking whole files (--dist loadfile: a module's
# seed checkpoints and references are built once); 1 runs everything in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,-p no:xdist)
test: venv lint
	$(PY) -m pytest -q -x $(XDIST) --durations=15 tests --ignore=tests/custom_ops_interp
	TRITON_INTERPRET=1 $(PY) -m pytest -q -x $(XDIST) tests/custom_ops_interp

test-fast: venv
	$(PY) -m pytest -q -x $(XDIST) -m "not slow" tests --ignore=tests/custom_ops_interp

# The GPU image (Python 3.12, torch 2.11, triton 3.6, torchtitan only from wheels/) rehearsed on
# the CPU in a venv of its own: both dry runs of benchmarks/gpu_check.sh end to end (not in test).
gpu-rehearsal:
	benchmarks/gpu_rehearsal.sh

bench: venv
	$(PY) -m benchmarks.ops

clean-venv:
	rm -rf $(VENV)

# eval "$(make -s env)": this project's Python first on PATH, the clone on PYTHONPATH.
env: venv
	@echo 'export PATH="$(VENV)/bin:$$PATH" PYTHONPATH="$(CURDIR)" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1'
