"""docker-compose.yml and the Dockerfile agree with the code (no Docker engine needed: the files are
parsed). Pins: the six services; one image for every app service; the environment names are exactly
those ``controlplane.env`` reads, with one value each across services; the Ray head is not on
Redis's port 6379; the GPU worker reserves NVIDIA GPUs; web migrates before it serves; and the web
environment passes ``manage.py check --deploy`` under the production settings."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from controlplane import env as envmod

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
APP_SERVICES = ("web", "celery", "ray-head", "ray-gpu-worker")
CONNECTIONS = ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "RAY_ADDRESS")
# Read by something other than controlplane.env: Django itself and Ray's token authentication.
OTHER_READERS = {"DJANGO_SETTINGS_MODULE", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}


class _RecordingEnviron(dict):
    def __init__(self) -> None:
        super().__init__()
        self.read: set[str] = set()

    def get(self, key, default=None):
        self.read.add(key)
        return default

    def __getitem__(self, key):
        self.read.add(key)
        raise KeyError(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return False


def names_env_reads(monkeypatch) -> set[str]:
    """Every variable ``controlplane.env.load()`` looks at (recorded, not parsed from source)."""
    recorder = _RecordingEnviron()
    fake_os = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    fake_os.environ = recorder
    monkeypatch.setattr(envmod, "os", fake_os)
    envmod.load()
    return recorder.read


def interpolate(value: str, given: dict[str, str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$ (``given`` supplies required values)."""
    given = given or {}

    def sub(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in given:
            return given[name]
        if op == ":-":
            return arg
        raise AssertionError(f"{name} is required ({arg}) and was not given")

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", sub, value).replace("$$", "$")


def env_of(service: str) -> dict[str, str]:
    environment = SERVICES[service].get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {k: str(v) for k, v in environment.items()}


def command_of(service: str) -> str:
    command = SERVICES[service]["command"]
    return command if isinstance(command, str) else " ".join(command)


def test_all_six_services_exist():
    assert set(SERVICES) == {"postgres", "redis", "web", "celery", "ray-head", "ray-gpu-worker"}


def test_every_app_service_runs_the_one_image_built_from_the_repo():
    images = {SERVICES[s].get("image") for s in APP_SERVICES}
    builds = {repr(SERVICES[s].get("build")) for s in APP_SERVICES}
    assert len(images) == 1 and None not in images
    assert len(builds) == 1
    build = SERVICES["web"]["build"]
    assert (build if isinstance(build, str) else build["context"]) == "."


def test_environment_names_are_exactly_those_the_code_reads(monkeypatch):
    read = names_env_reads(monkeypatch)
    # The conventional connection names are read as they are; compose sets exactly those.
    assert {n for n in read if not n.startswith("STRATA_")} == set(CONNECTIONS)
    for service in APP_SERVICES:
        names = set(env_of(service))
        unknown = names - read - OTHER_READERS
        assert not unknown, f"{service} sets variables nothing reads: {sorted(unknown)}"
        assert set(CONNECTIONS) <= names, f"{service} lacks {set(CONNECTIONS) - names}"


def test_connection_values_agree_across_services_and_point_at_them():
    for name in CONNECTIONS:
        assert len({env_of(s)[name] for s in APP_SERVICES}) == 1, f"{name} differs between services"
    env = env_of("web")
    assert "@postgres:5432/" in env["DATABASE_URL"] and env["DATABASE_URL"].startswith("postgres://")
    assert env["CELERY_BROKER_URL"].startswith("redis://redis:6379/")
    assert env["REDIS_URL"].startswith("redis://redis:6379/")
    assert env["CELERY_BROKER_URL"] != env["REDIS_URL"]  # broker and L3 store in separate databases


def test_ray_head_port_is_not_redis_port_and_everyone_uses_it():
    head = re.search(r"--port[= ](\d+)", command_of("ray-head"))
    assert head is not None and "--head" in command_of("ray-head")
    port = head.group(1)
    assert port != "6379"
    assert env_of("web")["RAY_ADDRESS"] == f"ray-head:{port}"
    for joiner in ("ray-gpu-worker", "web", "celery"):
        assert '--address="$$RAY_ADDRESS"' in command_of(joiner), joiner


def test_ray_requires_a_token_on_every_node():
    for service in APP_SERVICES:
        env = env_of(service)
        assert env["RAY_AUTH_MODE"] == "token"
        assert ":?" in env["RAY_AUTH_TOKEN"]  # compose refuses to start without one


def test_gpu_worker_reserves_nvidia_gpus():
    devices = SERVICES["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "--head" not in command_of("ray-gpu-worker")


def test_web_migrates_then_serves_the_asgi_app_and_celery_runs_the_worker():
    web = command_of("web")
    assert "manage.py migrate --noinput" in web
    assert web.index("migrate") < web.index("uvicorn controlplane.asgi:application")
    assert "celery -A controlplane.celery_app worker" in command_of("celery")
    for service in ("web", "celery"):
        needs = SERVICES[service]["depends_on"]
        assert needs["postgres"]["condition"] == "service_healthy"
        assert needs["redis"]["condition"] == "service_healthy"


def test_dockerfile_is_python_slim_installs_requirements_and_torch_is_configurable():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert "pip install -r requirements.txt" in dockerfile
    assert re.search(r"^ARG TORCH_INDEX", dockerfile, re.M) and "${TORCH_INDEX:+--index-url" in dockerfile
    assert re.search(r"^USER (?!root)", dockerfile, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".strata", ".env"} <= set(ignored)


def test_web_environment_passes_django_deploy_checks(tmp_path):
    """The production settings accept what compose sets (secrets filled with stand-ins)."""
    given = {"POSTGRES_PASSWORD": "pw", "RAY_AUTH_TOKEN": "t" * 64, "STRATA_SECRET_KEY": secrets.token_urlsafe(50)}
    env = {k: interpolate(v, given) for k, v in env_of("web").items()}
    env["STRATA_HOME"] = str(tmp_path)  # the container's /var/lib/strata is not writable here
    env["STRATA_WEIGHTS_ROOT"] = str(tmp_path / "weights")
    child_env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", str(tmp_path)), **env}
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("raw", "expected"), [
    ("${A:-x}", "x"), ("${B:?need B}", "given"), ("$$RAY_ADDRESS", "$RAY_ADDRESS"), ("plain", "plain"),
])
def test_interpolate_helper(raw, expected):
    assert interpolate(raw, {"B": "given"}) == expected
