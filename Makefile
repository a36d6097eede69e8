# One command each: `make lab` (JupyterLab on chapters/, chapter 00 open) and `make test` (the
# whole CPU suite, browser test included).
# Both create .venv when it is missing and reuse it after; it is reinstalled when pyproject.toml
# changes. TORCH picks the PyTorch build (on the course's CI machines 2.13.0 is a local CPU wheel).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)
GPU_PY ?= $(PY)
PORT   ?= 8888
# The folder `make lab` serves and the notebook it opens first (the browser test serves a copy).
LAB_DIR  ?= chapters
LAB_OPEN ?= 00_hardware_roofline.ipynb
ROOT_OK := $(if $(filter 0,$(shell id -u)),--allow-root)
NBVAL  := -p no:cacheprovider --nbval-lax --nbval-cell-timeout=900
# pytest processes (pytest-xdist) for the unit tests and the notebooks, a file each: most of the
# time is single-threaded kernel compiles and cells, so CI's 2 cores halve it. TEST_WORKERS=0: one.
TEST_WORKERS ?= 2

.PHONY: install lab test lint unit notebooks browser site chapters gpu-test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	@rm -f $(VENV)/.installed-*
	@touch $@

lab: install
	$(VENV)/bin/jupyter lab --notebook-dir=$(LAB_DIR) --port=$(PORT) $(ROOT_OK) \
		--LabApp.default_url=/lab/tree/$(LAB_OPEN) $(LAB_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(PY) -m utils.notebooks check
	$(PY) -m utils.notebooks stats

unit: install
	$(PY) -m pytest -q -m "not browser" -n $(TEST_WORKERS) --dist loadfile tests

# The solved notebooks run once, strict, keeping their outputs for the site (utils.execute);
# the learner copies and the labs run under nbval.
notebooks: install
	$(PY) -m utils.execute solutions
	$(PY) -m pytest -q $(NBVAL) -n $(TEST_WORKERS) --dist loadfile chapters/ $(wildcard labs/*.ipynb)

# JupyterLab (as `make lab` serves it) and the built site, in headless Chromium: every chapter
# run with Run All Cells. Skipped, saying why, where no Chromium is found (Debian: apt-get
# install chromium); screenshots land in build/browser-artifacts/.
browser: install site
	$(PY) -m pytest -q -p no:cacheprovider -m browser tests/test_browser.py

# The course as a static website, from the solved notebooks executed here (reusing what
# `make notebooks` executed when the tree has not changed since): build/site/.
site: install
	$(PY) -m utils.site build

test: lint unit notebooks browser

chapters: install
	$(PY) -m utils.notebooks build

# On a GPU machine. On the course's H200 (no network) the CuTe DSL comes from the device staging
# and the command is `make gpu-test GPU_PY=python3` (see README).
gpu-test: $(if $(filter $(PY),$(GPU_PY)),install)
	$(GPU_PY) -m pytest -q -m gpu -p no:cacheprovider tests/gpu
	COURSE_STRICT_EXERCISES=1 $(GPU_PY) -m pytest -q $(NBVAL) solutions/

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build
