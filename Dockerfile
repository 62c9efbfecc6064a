# One image for every Strata process: web (uvicorn ASGI), Celery worker, Ray head and Ray (GPU) workers.
#
#   docker build -t strata .                                   # torch from PyPI (Linux wheels bundle CUDA)
#   docker build -t strata --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .     # CPU only, smaller
#   docker build -t strata --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .   # a given CUDA
# The console's front-end packages from the npm registry, pinned by frontend/package-lock.json.
FROM node:20-slim AS frontend
WORKDIR /frontend
COPY frontend/package.json frontend/package-lock.json ./
RUN npm ci --no-audit --no-fund

FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app:/app/platform \
    DJANGO_SETTINGS_MODULE=controlplane.settings.production \
    STRATA_HOME=/var/lib/strata \
    RAY_USAGE_STATS_ENABLED=0

WORKDIR /app

# Dependencies first (cached across code changes). torch is installed separately, as in the Makefile.
COPY requirements.txt ./
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"} \
    && pip install -r requirements.txt

COPY . .
COPY --from=frontend /frontend/node_modules/uplot/dist /app/frontend/node_modules/uplot/dist

# STRATA_HOME (database files, keys, logs) is the strata user's alone; a new named volume mounted
# there copies this mode, and the processes keep what they create in it 0600.
RUN useradd --create-home --uid 10001 strata \
    && install -d -m 0700 -o strata -g strata /var/lib/strata
USER strata

EXPOSE 8000
# The compose file gives each service its own command; alone, the image serves the web process
# (publish it on 127.0.0.1 and put a TLS-terminating proxy in front: `-p 127.0.0.1:8000:8000`).
CMD ["uvicorn", "controlplane.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
