"""What an operator sets up before the soak, through the admin API: models (two replicas each),
tenants with their quotas and weights, one API key and the grants of each; plus a staff login for
the console. ``Admin`` is the operator's client: it retries a write that got a retryable answer (503 or
429 with ``Retry-After``, or no connection), as an operator's script would, and records every answer.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass, field

import httpx

RETRYABLE_STATUS = (429, 503)


@dataclass(frozen=True)
class TenantSpec:
    slug: str
    profile: str  # steady, chat, burst, quota, kv, ops (see bench._soak.load)
    quotas: dict = field(default_factory=dict)


def tenant_specs(run_id: str) -> list[TenantSpec]:
    """The soak's tenants: different quotas and weights (``share_weight``)."""
    return [
        TenantSpec(f"steady-{run_id}", "steady", {"share_weight": 3}),
        TenantSpec(f"chat-{run_id}", "chat", {"share_weight": 2}),
        TenantSpec(f"burst-{run_id}", "burst", {"share_weight": 1, "max_concurrent_requests": 2}),
        TenantSpec(f"quota-{run_id}", "quota", {"requests_per_minute": 20, "tokens_per_minute": 4000}),
        TenantSpec(f"kv-{run_id}", "kv", {"share_weight": 1}),
        TenantSpec(f"ops-{run_id}", "ops", {"share_weight": 1}),
    ]


@dataclass
class AdminAnswer:
    at: float
    method: str
    path: str
    status: int | None  # None: no connection
    retry_after: bool
    attempts: int


class Admin:
    """The operator's admin API client (bearer token)."""

    def __init__(self, url: str, token: str, clock) -> None:
        # Creating a vLLM deployment answers after its checkpoint is checked: minutes on a busy 2-core machine.
        self.client = httpx.AsyncClient(base_url=f"{url}/api/admin/", timeout=300,
                                         headers={"Authorization": f"Bearer {token}"})
        self.clock = clock
        self.answers: list[AdminAnswer] = []

    async def close(self) -> None:
        await self.client.aclose()

    async def call(self, method: str, path: str, *, json: dict | None = None, retry_s: float = 120.0) -> httpx.Response:
        """One request, retried while the answer is retryable (up to ``retry_s``); the last answer."""
        deadline, attempts = time.monotonic() + retry_s, 0
        while True:
            attempts += 1
            try:
                resp = await self.client.request(method, path, json=json)
            except httpx.TransportError:
                self.answers.append(AdminAnswer(self.clock(), method, path, None, False, attempts))
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)
                continue
            retry_after = "retry-after" in resp.headers
            self.answers.append(AdminAnswer(self.clock(), method, path, resp.status_code, retry_after, attempts))
            if resp.status_code in RETRYABLE_STATUS and time.monotonic() < deadline:
                await asyncio.sleep(min(5.0, float(resp.headers.get("retry-after", "1") or 1)))
                continue
            return resp

    async def ok(self, method: str, path: str, *, json: dict | None = None) -> dict:
        resp = await self.call(method, path, json=json)
        if resp.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status_code} {resp.text[:300]}")
        return resp.json() if resp.content else {}


async def create_fleet(admin: Admin, specs: list[TenantSpec], models: list[dict]) -> dict[str, str]:
    """Create ``models`` (admin API bodies), the tenants, one key each and every grant; the keys by slug."""
    for body in models:
        await admin.ok("POST", "models", json=body)
    keys: dict[str, str] = {}
    for spec in specs:
        await admin.ok("POST", "tenants", json={"slug": spec.slug, "name": spec.slug, "quotas": spec.quotas})
        keys[spec.slug] = (await admin.ok("POST", f"tenants/{spec.slug}/keys"))["key"]
        for body in models:
            await admin.ok("POST", f"tenants/{spec.slug}/grants", json={"model": body["name"]})
    return keys


def job_id(body: dict) -> int | None:
    """The job id in an answer that queued one (a job view, ``{"job": {...}}`` or ``{"id"}``)."""
    if isinstance(body.get("job"), dict):
        return int(body["job"]["id"])
    return int(body["id"]) if "id" in body else None


class Console:
    """A staff user's session on the operator UI (``/ui/``): created with ``manage.py createsuperuser``,
    logged in through the login form as a browser would."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.AsyncClient(base_url=url, timeout=60, follow_redirects=True)
        self.password = secrets.token_urlsafe(18)

    async def login(self, username: str) -> None:
        page = await self.client.get("/ui/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        if token is None:
            raise RuntimeError(f"no CSRF token on the login page ({page.status_code})")
        resp = await self.client.post("/ui/login/", data={"username": username, "password": self.password,
                                                          "csrfmiddlewaretoken": token.group(1)},
                                      headers={"Referer": f"{self.url}/ui/login/"})
        if "/ui/login/" in str(resp.url):
            raise RuntimeError(f"console login refused ({resp.status_code})")

    async def read(self, path: str) -> int | None:
        try:
            return (await self.client.get(path)).status_code
        except httpx.TransportError:
            return None

    async def close(self) -> None:
        await self.client.aclose()
