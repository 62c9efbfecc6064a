"""``manage.py strata_demo [--base-url URL] [--rotate] [--model-path DIR]``: a ready-to-try platform.

Creates what is missing, never duplicates (safe to run on every start):

- an admin operator token (username ``demo-admin``) for the admin API;
- a Django superuser ``admin`` with a random password, for ``/admin/`` and the operator UI;
- tenants ``acme`` and ``globex`` with one API key each (named ``demo``);
- the model deployment ``demo-small`` (preset ``small``, revision ``r1`` seed 1), granted to both;
  with ``--model-path DIR`` (default ``$STRATA_DEMO_MODEL``) instead ``demo-hf``, serving the Hugging
  Face checkpoint directory DIR (revision ``r1``) with its own tokenizer and chat template, on the
  default engine (``registry.engines``: vLLM when installed and able to serve it here, else strata).

Secrets are printed when they are created and stored nowhere in clear (keys and tokens are kept as
digests, the password as Django's hash), so a later run shows prefixes only; ``--rotate`` revokes
the demo's own key and token, sets a new admin password and prints the new ones. Every change goes
through the control plane's services and is audited.
"""

from __future__ import annotations

import getpass
import json
import secrets
import shlex
from dataclasses import dataclass, field

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.db.models import Q
from django.utils import timezone

import strata_env
from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import ApplicationError
from controlplane.operators.accounts import audited_save
from controlplane.operators.models import OperatorToken
from controlplane.operators.services import operator_token_create, operator_token_revoke
from controlplane.registry.models import ModelDeployment
from controlplane.registry.services import model_create
from controlplane.tenants.access import grant_create
from controlplane.tenants.models import ApiKey, Grant, Tenant
from controlplane.tenants.services import api_key_create, api_key_revoke, tenant_create

TENANTS = (("acme", "Acme Corp"), ("globex", "Globex Corporation"))
# Demo tenants may pin a named cache or two (the README's /v1/caches example); the default pins nothing.
DEMO_QUOTAS = {"max_pinned_tokens": 4096}
MODEL = {"name": "demo-small", "preset": "small", "revision": {"label": "r1", "seed": 1}}
CHECKPOINT_MODEL = "demo-hf"
OPERATOR = "demo-admin"
SUPERUSER = "admin"
KEY_NAME = "demo"


@dataclass
class Outcome:
    """What this run did; secrets only for what it created now."""

    token: str | None = None
    token_prefix: str = ""
    password: str | None = None
    keys: dict[str, str] = field(default_factory=dict)  # slug -> raw key, created now
    prefixes: dict[str, str] = field(default_factory=dict)  # slug -> prefix of the live demo key
    created: list[str] = field(default_factory=list)


def _manage_prefix() -> str:
    """The variables a ``manage.py`` run needs in front of it to reach this platform's state and
    demo (nothing on the defaults), the way the launcher prints its own recipes."""
    env = strata_env.load()
    parts = []
    if env.home.resolve() != strata_env.home({}).resolve():
        parts.append(f"STRATA_HOME={shlex.quote(str(env.home))}")
    if env.database_url:
        parts.append('DATABASE_URL="$DATABASE_URL"')
    if env.demo_model:
        parts.append(f"STRATA_DEMO_MODEL={shlex.quote(env.demo_model)}")
    return " ".join(parts) + " " if parts else ""


def _actor() -> Actor:
    try:
        return Actor.cli(getpass.getuser())
    except Exception:  # no user name in some containers
        return Actor.cli()


class Command(BaseCommand):
    help = "Create demo tenants, keys, a model, an admin user and an operator token (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                            help="where the platform is served (for the printed examples)")
        parser.add_argument("--rotate", action="store_true",
                            help="replace the demo key of each tenant, the demo token and the admin password")
        parser.add_argument("--model-path", default=strata_env.load().demo_model,
                            help="serve this Hugging Face checkpoint directory as model demo-hf "
                                 "(default $STRATA_DEMO_MODEL) instead of the seeded demo-small")

    def handle(self, *args, base_url: str, rotate: bool, model_path: str | None = None, **options):
        executor = MigrationExecutor(connection)
        if executor.migration_plan(executor.loader.graph.leaf_nodes()):
            raise CommandError("the database is not migrated: run manage.py migrate first")
        actor = _actor()
        out = Outcome()
        self.model = (MODEL if not model_path else
                      {"name": CHECKPOINT_MODEL, "preset": "", "revision": {"label": "r1", "path": model_path}})
        try:
            self._operator_token(actor, out, rotate)
            self._superuser(actor, out, rotate)
            deployment = self._model(actor, out)
            for slug, name in TENANTS:
                tenant = self._tenant(actor, out, slug, name)
                self._key(actor, out, tenant, rotate)
                if not Grant.objects.filter(tenant=tenant, deployment=deployment).exists():
                    grant_create(actor=actor, tenant=tenant, deployment=deployment)
                    out.created.append(f"grant {slug} -> {deployment.name}")
        except ApplicationError as exc:
            raise CommandError(exc.message) from None
        self._report(out, base_url.rstrip("/"))

    # ------------------------------------------------------------------ steps
    def _operator_token(self, actor: Actor, out: Outcome, rotate: bool) -> None:
        def live():
            return OperatorToken.objects.filter(  # an expired demo token is replaced like a revoked one
                Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()), username=OPERATOR,
                role=OperatorToken.Role.ADMIN, revoked_at__isnull=True)

        if rotate:
            for token in live():
                operator_token_revoke(actor=actor, token=token)
        existing = live().first()
        if existing is not None:
            out.token_prefix = existing.prefix
            return
        token, out.token = operator_token_create(actor=actor, username=OPERATOR, role=OperatorToken.Role.ADMIN)
        out.token_prefix = token.prefix
        out.created.append(f"operator token {token.prefix}... ({OPERATOR}, admin)")

    def _superuser(self, actor: Actor, out: Outcome, rotate: bool) -> None:
        users = get_user_model()
        user = users.objects.filter(username=SUPERUSER).first()
        if user is not None and not rotate:
            return
        password = secrets.token_urlsafe(12)
        with transaction.atomic(), audited_save():  # attributed below, not as system:unattributed
            if user is None:
                users.objects.create_superuser(username=SUPERUSER, email="", password=password)
                action = "user.create"
            else:
                user.set_password(password)
                user.save(update_fields=["password"])
                action = "user.set_password"
            audit_record(actor=actor, action=action, target=SUPERUSER, new={"username": SUPERUSER, "superuser": True})
        out.password = password
        out.created.append(f"superuser {SUPERUSER}" if action == "user.create" else f"new password for {SUPERUSER}")

    def _model(self, actor: Actor, out: Outcome) -> ModelDeployment:
        deployment = ModelDeployment.objects.filter(name=self.model["name"]).first()
        if deployment is None:
            deployment = model_create(actor=actor, **self.model)
            out.created.append(f"model {self.model['name']} ({self._model_source()}, engine {deployment.engine}, "
                               "revision r1)")
        return deployment

    def _model_source(self) -> str:
        path = self.model["revision"].get("path")
        return f"checkpoint {path}" if path else f"preset {self.model['preset']}, seed 1"

    def _tenant(self, actor: Actor, out: Outcome, slug: str, name: str) -> Tenant:
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:
            tenant = tenant_create(actor=actor, slug=slug, name=name, quotas=DEMO_QUOTAS)
            out.created.append(f"tenant {slug}")
        elif not tenant.is_active:
            self.stderr.write(f"warning: tenant {slug} is {tenant.status}; its key will not work until it is active")
        return tenant

    def _key(self, actor: Actor, out: Outcome, tenant: Tenant, rotate: bool) -> None:
        def live():
            return ApiKey.objects.filter(tenant=tenant, name=KEY_NAME, revoked_at__isnull=True)

        if rotate:
            for key in live():
                api_key_revoke(actor=actor, api_key=key, reason="strata_demo --rotate")
        existing = live().first()
        if existing is not None:
            out.prefixes[tenant.slug] = existing.prefix
            return
        if tenant.status == Tenant.Status.OFFBOARDED:
            return
        key, out.keys[tenant.slug] = api_key_create(actor=actor, tenant=tenant, name=KEY_NAME)
        out.prefixes[tenant.slug] = key.prefix
        out.created.append(f"API key {key.prefix}... for {tenant.slug}")

    # ------------------------------------------------------------------ output
    def _report(self, out: Outcome, base: str) -> None:
        w = self.stdout.write
        w("Strata demo: " + ("created " + ", ".join(out.created) if out.created else "everything already exists"))
        w("")
        w(f"Operator UI      {base}/ui/   user {SUPERUSER}   password "
          + (out.password if out.password else "(unchanged; shown when it was created)"))
        if out.token:
            w(f"Admin API token  {out.token}")
            w(f"  curl -H 'Authorization: Bearer {out.token}' {base}/api/admin/tenants")
        else:
            w(f"Admin API token  {out.token_prefix}... (shown when it was created)")
        w("")
        w("Tenant API keys (shown only now: store them)" if out.keys else "Tenant API keys")
        for slug, _ in TENANTS:
            raw = out.keys.get(slug)
            shown = raw if raw else (f"{out.prefixes[slug]}... (shown when it was created)"
                                     if slug in out.prefixes else "(none: tenant offboarded)")
            w(f"  {slug:<8} {shown}")
        w(f"Model {self.model['name']} ({self._model_source()}, revision r1) is granted to "
          + " and ".join(slug for slug, _ in TENANTS))
        w("")
        key = out.keys.get("acme") or "$ACME_KEY"
        name = self.model["name"]
        body = json.dumps({"model": name, "prompt": "The cache remembers", "max_tokens": 16})
        w("Try it (OpenAI-compatible):")
        w(f'  curl {base}/v1/completions -H "Authorization: Bearer {key}" \\')
        w(f"       -H 'Content-Type: application/json' -d {shlex.quote(body)}")
        w("  .venv/bin/python -c \"from openai import OpenAI; "
          f"c = OpenAI(base_url='{base}/v1', api_key='{key}'); "
          f"r = c.completions.create(model='{name}', prompt='The cache remembers', max_tokens=16); "
          "print(r.choices[0].text, r.usage)\"")
        if not out.keys:
            w(f"New keys, token and password: {_manage_prefix()}.venv/bin/python manage.py strata_demo --rotate")
