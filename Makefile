# The course's commands. `make run` and `make test` set themselves up (a local .venv) on first use.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# CPU-only machines get the CPU build of torch (smaller, and the one CI uses); GPU machines get pip's default.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=1800
NOTEBOOKS := notebooks solutions exercises

.PHONY: help setup run test test-lib test-notebooks lab gpu-suite notebooks exercises clean

help:
	@echo "make run        execute every notebook headless here, render build/html/index.html"
	@echo "make test       unit tests + every notebook under nbval (strict)"
	@echo "make lab        open JupyterLab on the course"
	@echo "make gpu-suite  on a CUDA machine: execute notebooks in place, nbval them, write reports/gpu/latest.json"

$(VENV)/.installed: pyproject.toml
	@test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -e ".[test]"
	@touch $@

setup: $(VENV)/.installed

run: setup
	$(VPY) tools/run_course.py

test: setup
	$(VPY) -m pytest -q tests $(NBVAL) $(NOTEBOOKS)

test-lib: setup
	$(VPY) -m pytest -q tests

test-notebooks: setup
	$(VPY) -m pytest -q $(NBVAL) $(NOTEBOOKS)

lab: setup
	$(VPY) -m jupyter lab notebooks/00_start_here.ipynb

# On a GPU host: see README "Running the GPU suite". Uses the Python on PATH (no venv): the host's torch.
gpu-suite:
	$(PY) tools/gpu_suite.py

# Authoring: rebuild .ipynb files from their percent-format sources; regenerate exercises from solutions.
notebooks: setup
	$(VPY) tools/nbbuild.py

exercises: setup
	$(VPY) tools/make_exercises.py

clean:
	rm -rf build
