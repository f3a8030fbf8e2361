# The course's commands. `make run` and `make test` set themselves up (a local .venv) on first use.
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
comma := ,
# A GPU machine (nvidia-smi on PATH) also gets the "gpu" extra (FlashInfer, CUDA-only) and pip's default torch.
# A CPU-only machine gets the CPU build of torch and no CUDA-only package. On a Linux laptop with internet,
# add TORCH_INDEX=https://download.pytorch.org/whl/cpu so that pip finds the CPU build there.
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
# An AMD GPU (rocm-smi, no nvidia-smi) is not set up automatically: set-up says so and installs the CPU build.
HAS_ROCM := $(if $(HAS_GPU),,$(shell command -v rocm-smi >/dev/null 2>&1 && echo yes))
ROCM_NOTE := make setup: rocm-smi found, no nvidia-smi: the course does not set up ROCm automatically, so this installs the CPU build of torch (lessons replay the recorded GPU run); for your AMD GPU install torch by hand from pip's ROCm index, e.g. $(VPY) -m pip install torch --index-url https://download.pytorch.org/whl/rocm6.4 (the ROCm version you have: pytorch.org/get-started)
KIND := $(if $(HAS_GPU),gpu,cpu)
# lab: JupyterLab and the notebook tools (pyproject.toml keeps them out of a plain `pip install`, e.g. on Colab)
EXTRAS := $(if $(HAS_GPU),lab$(comma)test$(comma)site$(comma)gpu,lab$(comma)test$(comma)site)
TORCH_SPEC ?= $(if $(HAS_GPU),torch>=2.11$(comma)<2.15,torch==2.13.0)
TORCH_INDEX ?=
STAMP := $(VENV)/.installed-$(KIND)
# Set-up runs under a lock (two `make test` started at once: the second waits, then finds the venv ready).
LOCKED := $(PY) -c 'import fcntl, subprocess, sys; f = open(sys.argv[1], "a"); fcntl.flock(f, fcntl.LOCK_EX); sys.exit(subprocess.call(sys.argv[2:]))' $(VENV).lock
NBVAL := --nbval --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=1800
# the tests run on up to 4 of this machine's cores (pytest-xdist; WORKERS=1 runs them in one process): each
# module's tests, and each notebook's cells, stay in one worker (--dist loadscope, as nbval needs)
WORKERS ?= $(shell $(PY) -c 'import os; print(min(4, len(os.sched_getaffinity(0))))' 2>/dev/null || echo 1)
XDIST := $(if $(filter 1,$(WORKERS)),,-n $(WORKERS) --dist loadscope)
NOTEBOOKS := notebooks solutions exercises

.PHONY: help setup run test test-lib test-notebooks check lab gpu-suite notebooks exercises format publish clean docker

help:
	@echo "make run        execute every notebook headless here, render build/html/index.html"
	@echo "make test       unit tests + every notebook under nbval (strict)"
	@echo "make check      the fast inner loop: unit tests without those marked slow (make test runs all)"
	@echo "make lab        open JupyterLab on your own copy of the course in work/ (LAB_IP, LAB_PORT, LAB_ARGS; ALLOW_ROOT=1 to run as root)"
	@echo "make site       build the course website (build/site/) from the committed notebooks"
	@echo "make format     lay out the notebook and solution sources at 88 columns (ruff), then make notebooks exercises"
	@echo "make gpu-suite  on a CUDA machine: execute notebooks in place, nbval them, write reports/gpu/latest.json"
	@echo "make docker     build the course's image (CUDA, torch, FlashInfer's kernel built, JupyterLab on 8888)"
	@echo "make publish URL=https://github.com/OWNER/pinlab [REF=tag-or-commit]   the address and pinned version in every install cell, outputs kept"

# Reinstalls whenever pyproject.toml (the dependencies) or this Makefile changes.
$(STAMP): pyproject.toml Makefile
	@# a venv left half-built by an interrupted set-up (no working pip) is made again
	@$(VPY) -m pip --version >/dev/null 2>&1 || $(PY) -m venv --clear $(VENV)
	@rm -f $(VENV)/.installed-*
	@$(if $(and $(HAS_ROCM),$(if $(TORCH_INDEX),,yes)),echo "$(ROCM_NOTE)",true)
	$(VPY) -m pip install -q --upgrade pip
	@# --no-compile: no byte code for the whole of every package (about 230 MB); Python caches what it imports
	$(VPY) -m pip install -q --no-compile "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	$(VPY) -m pip install -q --no-compile -e ".[$(EXTRAS)]"
	@touch $@

setup:
	@$(LOCKED) $(MAKE) --no-print-directory $(STAMP)

run: setup
	$(VPY) tools/run_course.py

test: setup
	$(VPY) -m pytest -q $(XDIST) tests $(NBVAL) $(NOTEBOOKS)

test-lib: setup
	$(VPY) -m pytest -q tests

test-notebooks: setup
	$(VPY) -m pytest -q $(NBVAL) $(NOTEBOOKS)

# the fast inner loop: the unit tests without the heaviest (marked slow: site builds, fresh kernels and
# processes, wheels); make test and CI run everything
check: setup
	$(VPY) -m pytest -q $(XDIST) -m "not slow" tests

# JupyterLab on your copy of the course in LAB_WORK (tools/lab.py; default work/, made on first use): LAB_IP (default localhost), LAB_PORT (8888), LAB_ARGS (more jupyter lab
# arguments, split like a shell's words by lab.py, e.g. LAB_ARGS="--no-browser --ServerApp.base_url=/x/"). It prints
# the URL with its token, warns when LAB_IP is not a loopback address (plain HTTP: whoever has the URL gets a shell),
# refuses an empty token or password in any spelling, the XSRF check turned off and another config file (read as
# traitlets reads them: any class, =value or the next word, aliases), and refuses to run as root unless ALLOW_ROOT=1 is given on the
# command line. The three reach lab.py single-quoted and unexpanded (shq, $(value ...)): nothing in them is run by
# the shell or by make (LAB_ARGS="; echo INJECTED" gives JupyterLab the words ";", "echo" and "INJECTED").
LAB_IP ?= localhost
LAB_PORT ?= 8888
LAB_ARGS ?=
# your copy of the course (git-ignored): made from notebooks/, exercises/ and solutions/ on first use, never
# overwritten; delete a notebook there and run make lab again to start it over
LAB_WORK ?= work
# $(call shq,TEXT): TEXT as one single-quoted shell word (each ' in it written '\'')
shq = '$(subst ','\'',$(1))'
lab: setup
	$(VPY) tools/lab.py --python $(VPY) --ip $(call shq,$(value LAB_IP)) --port $(call shq,$(value LAB_PORT)) $(if $(and $(filter command line,$(origin ALLOW_ROOT)),$(filter 1,$(ALLOW_ROOT))),--allow-root) --work $(call shq,$(value LAB_WORK)) --lab-args=$(call shq,$(value LAB_ARGS))

# On a GPU host: see CONTRIBUTING.md, "Running the GPU suite". Uses the Python on PATH (no venv): the host's torch.
# Arguments through ARGS, e.g. make gpu-suite ARGS="--only 04" or ARGS="--repeat 5".
gpu-suite:
	$(PY) tools/gpu_suite.py $(ARGS)

# Publishing: the course's address and the tag or commit to install written once (pyproject.toml) and into the
# install cell of every source, notebook and exercise (tools/install_cell.py --publish); every output, the GPU evidence
# and the site stay as they are. REF: a tag or a 40-hex commit (default: git rev-parse HEAD; a branch is refused).
# URL and REF reach the tool single-quoted and unexpanded, e.g. make publish URL=https://github.com/OWNER/pinlab REF=v1.0
REF ?=
publish:
	$(PY) tools/install_cell.py --publish $(call shq,$(value URL)) --ref=$(call shq,$(value REF))

# Authoring: rebuild .ipynb files from their percent-format sources; regenerate exercises from solutions.
notebooks: setup
	$(VPY) tools/nbbuild.py

exercises: setup
	$(VPY) tools/make_exercises.py

# The notebook and solution sources laid out by ruff at 88 columns (pyproject.toml [tool.ruff]), so that no code line
# wraps on a phone (issue 49; tests/test_conventions.py checks it). Strings and comments ruff cannot split: by hand.
format: setup
	$(VPY) -m ruff format notebooks/src solutions/src

clean:
	rm -rf build

# The course as a website in build/site/ (tools/build_site.py: Sphinx + MyST-NB + Furo), built from the
# committed notebooks without executing them, in a light venv of its own (.venv-site: the `site` extra's
# packages only, no torch and not the course itself: the build imports neither).
SITE_VENV ?= .venv-site
SITE_PY := $(SITE_VENV)/bin/python
SITE_STAMP := $(SITE_VENV)/.installed
$(SITE_STAMP): pyproject.toml Makefile
	@$(SITE_PY) -m pip --version >/dev/null 2>&1 || $(PY) -m venv --clear $(SITE_VENV)
	@rm -f $@
	$(PY) tools/build_site.py --requirements > $(SITE_VENV)/requirements.txt
	$(SITE_PY) -m pip install -q --no-compile -r $(SITE_VENV)/requirements.txt
	@touch $@

.PHONY: site
site: $(SITE_STAMP)
	$(SITE_PY) tools/build_site.py

# The course's image (Dockerfile): CUDA + torch, pip install -e .[gpu,test], FlashInfer's decode kernel built,
# JupyterLab on 8888. Run it with: docker run --rm --gpus all -p 127.0.0.1:8888:8888 $(IMAGE)
IMAGE ?= pinlab
DOCKER_ARGS ?=
docker:
	docker build -t $(IMAGE) $(DOCKER_ARGS) .
