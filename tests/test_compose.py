"""docker-compose.yml and the Dockerfile agree with the code (no Docker engine needed: the files are
parsed). Pins: the six services plus the one-shot migrate job; one image for every app service; the
environment names are exactly those the control plane's view (``strata_env.load``) reads, with one
value each across services; the Ray head is not on Redis's port 6379; the GPU worker reserves NVIDIA
GPUs; migrations run as the schema-owning role before web and Celery start, and those connect as a
role with row access only (docker/postgres-init.sql; checked against a real PostgreSQL when
``DATABASE_URL`` names one); web is published on 127.0.0.1 only; and the web environment passes
``manage.py check --deploy`` under the production settings."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from controlplane import env as envmod

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
APP_SERVICES = ("web", "celery", "ray-head", "ray-cpu-worker", "ray-gpu-worker")
INIT_SQL = ROOT / "docker" / "postgres-init.sql"
CONNECTIONS = ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "RAY_ADDRESS")
# Read by something other than strata_env: Django itself and Ray's token authentication.
OTHER_READERS = {"DJANGO_SETTINGS_MODULE", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_worker_niceness"}  # not Strata's


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
    """Every variable the control plane's view (``strata_env.load``, re-exported by ``controlplane.env``)
    looks at (recorded, not parsed from source)."""
    recorder = _RecordingEnviron()
    envmod.load(recorder)
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


def test_all_six_services_and_the_migrate_job_exist():
    assert set(SERVICES) == {"postgres", "redis", "web", "celery", "ray-head", "ray-cpu-worker", "ray-gpu-worker",
                             "migrate"}


def test_a_cpu_profile_and_a_gpu_profile_pick_the_worker():
    assert SERVICES["ray-cpu-worker"]["profiles"] == ["cpu"] and SERVICES["ray-gpu-worker"]["profiles"] == ["gpu"]
    assert "deploy" not in SERVICES["ray-cpu-worker"]  # no GPU reservation
    assert "--num-gpus=0" in command_of("ray-cpu-worker") and "strata_worker" in command_of("ray-cpu-worker")
    assert all("profiles" not in SERVICES[s] for s in SERVICES if s not in ("ray-cpu-worker", "ray-gpu-worker"))


def test_env_example_names_every_variable_the_compose_file_reads_and_checkpoints_are_mounted():
    example = (ROOT / ".env.example").read_text()
    given = {line.split("=", 1)[0] for line in example.splitlines() if line and not line.startswith("#")}
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)[:}?-]", (ROOT / "docker-compose.yml").read_text()))
    assert used - {"STRATA_TAG"} <= given, sorted(used - given)
    assert "COMPOSE_PROFILES" in given and ".env" in (ROOT / ".gitignore").read_text().split()
    for service in APP_SERVICES:
        mounts = SERVICES[service]["volumes"]
        assert "${STRATA_CHECKPOINTS:-./checkpoints}:/var/lib/strata/weights:ro" in mounts
    assert env_of("web")["STRATA_WEIGHTS_ROOT"] == "/var/lib/strata/weights"


def test_the_production_image_has_no_test_tools():
    runtime = (ROOT / "requirements.txt").read_text().lower()
    for tool in ("pytest", "playwright", "hypothesis", "ruff"):
        assert f"\n{tool}==" not in runtime and f"\n{tool}-" not in runtime, tool
    assert "requirements-dev.txt" not in (ROOT / "Dockerfile").read_text()


def test_every_app_service_runs_the_one_image_built_from_the_repo():
    images = {SERVICES[s].get("image") for s in (*APP_SERVICES, "migrate")}
    builds = {repr(SERVICES[s].get("build")) for s in (*APP_SERVICES, "migrate")}
    assert len(images) == 1 and None not in images
    assert len(builds) == 1
    build = SERVICES["web"]["build"]
    assert (build if isinstance(build, str) else build["context"]) == "."


def test_environment_names_are_exactly_those_the_code_reads(monkeypatch):
    read = names_env_reads(monkeypatch)
    # The conventional connection names are read as they are; compose sets exactly those.
    assert {n for n in read if not n.startswith("STRATA_")} == set(CONNECTIONS)
    for service in (*APP_SERVICES, "migrate"):
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
    for joiner in ("ray-cpu-worker", "ray-gpu-worker", "web", "celery"):
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


def test_the_migrate_job_runs_before_web_serves_and_celery_runs_the_worker():
    assert command_of("migrate") == "python manage.py migrate --noinput"
    assert SERVICES["migrate"]["restart"] == "no"  # one shot
    assert "migrate" not in command_of("web")
    assert "python -m workers.webserver" in command_of("web")
    assert "celery -A controlplane.celery_app worker" in command_of("celery")
    for service in ("web", "celery"):
        needs = SERVICES[service]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully"
        assert needs["postgres"]["condition"] == "service_healthy"
        assert needs["redis"]["condition"] == "service_healthy"


def _db_user(service: str) -> str:
    return urlsplit(interpolate(env_of(service)["DATABASE_URL"], {
        "STRATA_DB_APP_PASSWORD": "app-pw", "STRATA_DB_MIGRATE_PASSWORD": "migrate-pw"})).username


def test_migrations_run_as_the_schema_owner_and_the_app_connects_with_row_access_only():
    assert _db_user("migrate") == "strata_migrate"
    for service in APP_SERVICES:
        assert _db_user(service) == "strata_app", service
    postgres = SERVICES["postgres"]
    assert postgres["environment"]["POSTGRES_USER"] not in {"strata_app", "strata_migrate"}
    assert "./docker/postgres-init.sql:/docker-entrypoint-initdb.d/10-strata-roles.sql:ro" in postgres["volumes"]
    for name in ("STRATA_DB_MIGRATE_PASSWORD", "STRATA_DB_APP_PASSWORD"):
        assert ":?" in postgres["environment"][name]  # the init script's passwords are required
    for service in APP_SERVICES:  # the app never learns the migrate role's or the superuser's password
        values = " ".join(env_of(service).values())
        assert "STRATA_DB_MIGRATE_PASSWORD" not in values and "POSTGRES_PASSWORD" not in values

    sql = INIT_SQL.read_text()
    assert re.search(r"ALTER SCHEMA public OWNER TO :\"migrate_role\"", sql)
    assert re.search(r"REVOKE ALL ON SCHEMA public FROM PUBLIC", sql)
    grants = re.findall(r"^\s*GRANT ([A-Z, ]+) ON (?:ALL )?(TABLES|SEQUENCES)\b[^;]*TO :\"app_role\"", sql, re.M)
    privileges = {kind: {p.strip() for p in privs.split(",")} for privs, kind in grants}
    assert privileges == {"TABLES": {"SELECT", "INSERT", "UPDATE", "DELETE"}, "SEQUENCES": {"USAGE", "SELECT"}}
    assert sql.count("ALTER DEFAULT PRIVILEGES FOR ROLE :\"migrate_role\"") == 2  # tables the migrations create
    assert not re.search(r"(TRUNCATE|TRIGGER|REFERENCES|CREATE|ALL PRIVILEGES)[^;]*TO :\"app_role\"", sql)


def test_web_runs_with_connection_limits_and_timeouts_and_does_not_trust_proxy_headers():
    command = command_of("web")
    for flag, name in (("--limit-concurrency", "STRATA_WEB_MAX_CONNECTIONS"),
                       ("--timeout-keep-alive", "STRATA_WEB_KEEPALIVE_S"),
                       ("--timeout-header", "STRATA_WEB_HEADER_TIMEOUT_S"),
                       ("--timeout-body", "STRATA_WEB_BODY_TIMEOUT_S")):
        assert f'{flag} "$${name}"' in command and name in env_of("web")
    assert "--proxy-headers" not in command and "--forwarded-allow-ips" not in command
    assert env_of("web")["STRATA_TRUSTED_PROXIES"] == "${STRATA_TRUSTED_PROXIES:-}"


def test_web_is_published_on_this_host_only_and_nothing_else_is_published():
    assert [interpolate(p) for p in SERVICES["web"]["ports"]] == ["127.0.0.1:8000:8000"]
    assert not [s for s in SERVICES if s != "web" and SERVICES[s].get("ports")]
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "TLS-terminating reverse proxy" in compose


def _postgres_admin_url() -> str | None:
    url = os.environ.get("DATABASE_URL", "")
    return url if url.startswith(("postgres://", "postgresql://")) and shutil.which("psql") else None


@pytest.mark.skipif(_postgres_admin_url() is None, reason="needs DATABASE_URL naming a PostgreSQL and psql")
def test_init_script_roles_on_a_real_postgres_the_app_role_cannot_touch_the_audit_guards(tmp_path):
    """docker/postgres-init.sql on a scratch database (role names made unique), migrations as the
    migrate role, then the app role: rows yes; dropping/disabling the audit triggers, altering or
    truncating the audit table, replacing the trigger function or creating tables no."""
    import psycopg
    from psycopg import errors

    admin = urlsplit(_postgres_admin_url())
    tag = f"{os.getpid()}_{secrets.token_hex(3)}"
    db, migrate_role, app_role = f"strata_roles_{tag}", f"strata_migrate_{tag}", f"strata_app_{tag}"
    host, port = admin.hostname or "127.0.0.1", admin.port or 5432

    def url(user: str, password: str, database: str) -> str:
        return f"postgres://{user}:{password}@{host}:{port}/{database}"

    admin_url = f"postgres://{admin.netloc}{admin.path}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db}"')
    try:
        env = {**os.environ, "PGPASSWORD": admin.password or "", "STRATA_DB_MIGRATE_USER": migrate_role,
               "STRATA_DB_APP_USER": app_role, "STRATA_DB_MIGRATE_PASSWORD": "migrate-pw",
               "STRATA_DB_APP_PASSWORD": "app-pw"}
        script = subprocess.run(
            ["psql", "-X", "-v", "ON_ERROR_STOP=1", "-h", host, "-p", str(port), "-U", admin.username or "postgres",
             "-d", db, "-f", str(INIT_SQL)], env=env, capture_output=True, text=True, timeout=60)
        assert script.returncode == 0, script.stdout + script.stderr

        child_env = {k: v for k, v in os.environ.items()
                     if not k.startswith("STRATA_") and k not in ("CELERY_BROKER_URL", "REDIS_URL")}
        child_env.update({"DATABASE_URL": url(migrate_role, "migrate-pw", db), "STRATA_HOME": str(tmp_path),
                          "DJANGO_SETTINGS_MODULE": "controlplane.settings.local",
                          "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'platform'}"})
        migrate = subprocess.run([sys.executable, "manage.py", "migrate", "--noinput"], cwd=ROOT, env=child_env,
                                 capture_output=True, text=True, timeout=300)
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr

        with psycopg.connect(url(app_role, "app-pw", db), autocommit=True) as app:
            app.execute("SELECT count(*) FROM audit_auditevent").fetchone()
            row = app.execute("INSERT INTO django_content_type (app_label, model) VALUES ('probe', 'probe') "
                              "RETURNING id").fetchone()  # rows and sequences: yes
            app.execute("UPDATE django_content_type SET model = 'probe2' WHERE id = %s", row)
            app.execute("DELETE FROM django_content_type WHERE id = %s", row)
            refused = [
                "DROP TRIGGER audit_auditevent_no_update_delete ON audit_auditevent",
                "ALTER TABLE audit_auditevent DISABLE TRIGGER ALL",
                "ALTER TABLE audit_auditevent ADD COLUMN note text",
                "TRUNCATE audit_auditevent",
                "CREATE OR REPLACE FUNCTION audit_auditevent_refuse_change() RETURNS trigger "
                "LANGUAGE plpgsql AS $$ BEGIN RETURN NEW; END $$",
                "CREATE TABLE probe (x int)",
                "DROP TABLE audit_auditevent",
            ]
            for statement in refused:
                with pytest.raises(errors.InsufficientPrivilege):
                    app.execute(statement)
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            for role in (app_role, migrate_role):
                conn.execute(f'DROP ROLE IF EXISTS "{role}"')


def test_dockerfile_is_python_slim_installs_requirements_and_torch_is_configurable():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert "pip install -r requirements.txt" in dockerfile
    assert re.search(r"^ARG TORCH_INDEX", dockerfile, re.M) and "${TORCH_INDEX:+--index-url" in dockerfile
    assert re.search(r"^USER (?!root)", dockerfile, re.M)
    assert "install -d -m 0700 -o strata -g strata /var/lib/strata" in dockerfile  # STRATA_HOME: owner only
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".strata", ".env"} <= set(ignored)


def test_web_environment_passes_django_deploy_checks(tmp_path):
    """The production settings accept what compose sets (secrets filled with stand-ins)."""
    given = {"STRATA_DB_APP_PASSWORD": "pw", "RAY_AUTH_TOKEN": "t" * 64, "STRATA_SECRET_KEY": secrets.token_urlsafe(50)}
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
