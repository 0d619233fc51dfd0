# Two commands for a newcomer:  `make book` (set up, build the site)  and  `make test` (every test CI runs).
PYTHON ?= python3
VENV   ?= .venv
# torch is installed first and on its own, so that nothing later pulls a different build.
# On a CPU-only machine with the CPU wheel at hand (CI) this is that wheel; elsewhere PyPI's default build.
TORCH  ?= torch==2.13.0
# Extra arguments for `python -m venv`. To keep a torch that is already installed (a CUDA build), let the
# venv see it and ask pip only for "torch", which that installation satisfies:
#   make VENV_ARGS=--system-site-packages TORCH=torch test
VENV_ARGS ?=
# pytest-xdist workers for `make unit` and `make notebooks`: one per core of CI's 2-core machine.
# WORKERS=0 runs each step in one pytest process, one test after the other.
WORKERS ?= 2
# CPU threads of torch (OMP_NUM_THREADS) in each worker and its chapter's kernel; WORKERS x THREADS should not
# exceed the cores. Two processes that each keep torch's default of one thread per core wait on each other's
# descheduled threads: a tiny training step ran 10-40x slower so on 2 cores (measured 2026-11-27).
THREADS ?= 1
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: venv book test unit notebooks hygiene twins site site-test chromium lint workflows linkcheck colab-like gpu-run gpu-test clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV_ARGS) $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[book,dev]"
	touch $(STAMP)

venv: $(STAMP)

book: $(STAMP) site
	@echo "The book is built: open $(CURDIR)/_build/html/index.html"

test: $(STAMP) lint unit notebooks hygiene twins workflows site site-test

# Test files spread over $(WORKERS) pytest-xdist workers (each test file whole on one worker: --dist loadfile),
# $(THREADS) torch thread(s) each.
unit:
	OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest tests -q -p no:cacheprovider -n $(WORKERS) --dist loadfile

# Every chapter, top to bottom in a fresh kernel, in the tiny profile (CPU-sized models), on $(WORKERS)
# pytest-xdist workers, $(THREADS) torch thread(s) each: --dist loadfile runs each notebook whole, in its own
# kernel, on one worker, and --no-loadscope-reorder keeps the order scripts/chapter_order.py gives (longest
# chapter first, from the "CPU tiny" minutes of notebooks/chapters.json; every notebook `pytest notebooks` collects).
notebooks:
	files=$$($(BIN)/python scripts/chapter_order.py notebooks) && \
	GPUBOOK_PROFILE=tiny MPLBACKEND=Agg OMP_NUM_THREADS=$(THREADS) $(BIN)/python -m pytest --nbval-lax --nbval-current-env -q -p no:cacheprovider \
	  -n $(WORKERS) --dist loadfile --no-loadscope-reorder $$files

hygiene:
	$(BIN)/python scripts/check_notebooks.py notebooks

# Each chapter's text twin (notebooks/NN_slug.py) is exactly what jupytext writes from the .ipynb.
# Reads only; to fix a pair: $(BIN)/jupytext --sync notebooks/NN_slug.ipynb
twins:
	$(BIN)/python scripts/check_twins.py notebooks

site:
	$(BIN)/jupyter-book build . --warningiserror --nitpick --keep-going

# Every page of the built site in headless Chromium, served on loopback: console errors, missing images,
# broken links and anchors, unrendered TeX, raw MyST roles, NaN cells, requests leaving the machine.
# Screenshots and page weights land in _build/site-test/. Chromium is the Debian package, installed
# here when missing; only if that install fails is the test skipped, saying so.
site-test: site
	@if command -v chromium >/dev/null || command -v chromium-browser >/dev/null || [ -n "$$CHROMIUM" ]; then \
	  $(BIN)/python scripts/site_test.py --html _build/html --out _build/site-test; \
	elif $(MAKE) --no-print-directory chromium; then \
	  $(BIN)/python scripts/site_test.py --html _build/html --out _build/site-test; \
	else \
	  $(BIN)/python scripts/site_test.py --html _build/html --out _build/site-test --allow-skip; \
	fi

chromium:
	@if [ "$$(id -u)" = 0 ]; then S=; else S="sudo -n"; fi; \
	$$S apt-get update -q >/dev/null && $$S env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null

lint:
	$(BIN)/ruff check helpers tests scripts notebooks book/_ext

# The GitHub Actions files parse, and every `make TARGET` they run exists here (scripts/check_workflows.py).
workflows:
	$(BIN)/python scripts/check_workflows.py .github/workflows

# Weekly (.github/workflows/weekly.yml): every external link of the book, checked by Sphinx.
linkcheck: $(STAMP)
	$(BIN)/jupyter-book build . --builder linkcheck

# Weekly: what a Colab reader gets. A clean venv with what Colab had preinstalled in late 2025
# (constraints/colab.txt: its torch, transformers 4.57, peft 0.17, accelerate ...), then the chapters' own
# install line (their setup cell's `%pip install`), then chapters 1 and 6 in the tiny profile with that
# installation (the checkout's helpers are not on the path). The install line names this repository on
# GitHub; COLAB_FROM=. (the default) installs the checkout in its place, with the same flags, so that the
# run tests the pins being changed; COLAB_FROM= (empty) runs the line exactly as a Colab reader does.
COLAB := .colab-venv
COLAB_FROM ?= .
COLAB_CHAPTERS ?= 01_memory_anatomy.ipynb 06_lora_qlora.ipynb
colab-like:
	rm -rf $(COLAB)
	$(PYTHON) -m venv $(COLAB)
	$(COLAB)/bin/python -m pip install -q -r constraints/colab.txt
	$(COLAB)/bin/python scripts/colab_install.py $(if $(COLAB_FROM),--source $(COLAB_FROM)) notebooks/01_memory_anatomy.ipynb
	$(COLAB)/bin/python -m pip install -q pytest nbval
	$(COLAB)/bin/python -m pip list 2>/dev/null | grep -iE "^(torch|transformers|peft|accelerate|bitsandbytes) " || true
	cd notebooks && GPUBOOK_PROFILE=tiny MPLBACKEND=Agg ../$(COLAB)/bin/python -m pytest --nbval-lax \
	  --nbval-current-env -q -p no:cacheprovider --rootdir=. $(COLAB_CHAPTERS)

# Maintainers, on a GPU machine: execute the chapters in the full profile, in place, in the order of
# notebooks/chapters.json (a chapter needing more GPUs than the machine has is skipped, saying so), stamp
# them, record their wall times in notebooks/execution_times.json, then check them. Refuses without CUDA.
# The status page (book/status.md) is rewritten from the result.
# T4 mode, EMULATE=t4 (both gpu-run and gpu-test): the single-GPU chapters (or CHAPTERS) run top to bottom
# with the big GPU answering like a Colab T4 (scripts/emulate_t4.py says what it cannot emulate: speed
# first), into EMULATE_OUT; the committed notebooks and the status page are not touched.
EMULATE ?=
EMULATE_OUT ?= _build/emulate-$(EMULATE)
gpu-run:
ifeq ($(strip $(EMULATE)),)
	env -u GPUBOOK_EMULATE $(PYTHON) scripts/execute_notebooks.py; status=$$?; $(PYTHON) scripts/status_page.py; exit $$status
else
	$(PYTHON) scripts/execute_notebooks.py --emulate $(EMULATE) --out $(EMULATE_OUT) $(CHAPTERS)
endif

# Maintainers, on a GPU machine (H100 or H200; chapter 7 needs 2 GPUs, else it is skipped, saying so):
# re-execute every chapter in the full profile into a temporary folder (the committed notebooks are not
# touched) and compare, cell by cell, every output that holds a memory number with the committed one after
# the regexes of notebooks/sanitize.cfg; cells listed in notebooks/gpu_check.json (timings, losses, NVML)
# are ignored with their reason. Prints cells checked/ignored per chapter and the run time. Then the GPU
# unit tests. CHAPTERS="notebooks/05_*.ipynb ..." checks only those chapters (one subset per GPU with
# CUDA_VISIBLE_DEVICES spreads the ~31 GPU-minutes of a full check over several GPUs).
# --restamp: a chapter whose every compared output reproduced gets a fresh execution stamp (the content
# hashes of the sources this run executed, its GPU and date, "verified by scripts/gpu_check.py") in the
# committed notebook's metadata, outputs untouched: commit the re-stamped notebooks (and book/status.md,
# rewritten from them). From a tree that differs from git HEAD it compares but does not re-stamp; without
# git, name the commit: GPUBOOK_COMMIT=SHA make gpu-test.
CHAPTERS ?=
gpu-test:
ifeq ($(strip $(EMULATE)),)
	env -u GPUBOOK_EMULATE $(PYTHON) scripts/gpu_check.py --restamp $(CHAPTERS); status=$$?; $(PYTHON) scripts/status_page.py; exit $$status
	env -u GPUBOOK_EMULATE $(PYTHON) -m pytest -m gpu tests -q -p no:cacheprovider
else
	$(PYTHON) scripts/execute_notebooks.py --emulate $(EMULATE) --out $(EMULATE_OUT) $(CHAPTERS)
endif

clean:
	rm -rf _build
