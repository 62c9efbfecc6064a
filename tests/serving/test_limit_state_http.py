"""Limit and lockout state survives a flood of anonymous traffic, and several web processes enforce
one limit (issue 42, item 1), mounted over HTTP against real web processes (``workers.webserver``,
as ``make run`` starts them) on the test database.

The victim's state is made first from 127.0.0.1: a tenant with ``requests_per_minute=3`` uses its
three requests, a bad operator token locks its source, and failed logins lock the (``admin``,
source) pair. Then 127.0.0.2 posts hundreds of logins with new user names (each refusal writes
fresh audit-aggregation keys, which used to share Django's 300-entry local-memory cache with every
limit and lockout and cull them). Afterwards every piece of the victim's state still holds.
Embedded default: one web process, no Redis. With ``REDIS_URL``: two web processes on one Redis
(this test's own ``redis-server``), the flood on one and the checks on both, and the tenant's
requests alternating between them count against one limit.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.live_db import database_url
from workers import launcher

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
FLOOD = 400
VICTIM_PASSWORD = "correct horse battery staple"


class Web:
    """One real web process on the test database (settings ``test_worker``)."""

    def __init__(self, tmp: Path, extra_env: dict[str, str]) -> None:
        self.port = launcher.free_port()
        env = {key: value for key, value in os.environ.items() if key != "REDIS_URL"}
        env.update({"DJANGO_SETTINGS_MODULE": "controlplane.settings.test_worker", "DATABASE_URL": database_url(),
                    "STRATA_TEST_THROTTLE_NAMESPACE": f"limits-{os.getpid()}-{tmp.name}",
                    "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "platform")]), **extra_env})
        self.log = (tmp / f"web-{self.port}.log").open("wb")
        self.proc = subprocess.Popen(launcher.web_argv(sys.executable, self.port, env), cwd=REPO, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self) -> None:
        for _ in range(1200):
            if launcher.port_open("127.0.0.1", self.port):
                return
            assert self.proc.poll() is None, Path(self.log.name).read_text()[-3000:]
            time.sleep(0.1)
        raise AssertionError("the web process did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def victim(transactional_db, actor, django_user_model):
    from controlplane.tenants.services import api_key_create, tenant_create

    tenant = tenant_create(actor=actor, slug="acme", name="Acme", quotas={"requests_per_minute": 3})
    django_user_model.objects.create_superuser("admin", "admin@example.com", VICTIM_PASSWORD)
    return api_key_create(actor=actor, tenant=tenant)[1]


@pytest.fixture
def webs(tmp_path, request):
    """``request.param`` web processes; with two, both on this test's own Redis."""
    count, started = request.param, []
    redis = None
    extra: dict[str, str] = {}
    if count > 1:
        server = shutil.which("redis-server")
        if server is None:
            pytest.skip("redis-server is not installed")
        redis_port = launcher.free_port()
        redis = subprocess.Popen([server, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        extra["REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
    try:
        started = [Web(tmp_path, extra) for _ in range(count)]
        for web in started:
            web.wait()
        yield started
    finally:
        for web in started:
            web.stop()
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=30)


def _complete(web: Web, key: str) -> int:
    """One counted tenant request (the gate counts it; its unknown model is then a 404)."""
    response = httpx.post(f"{web.url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                          json={"model": "no-such-model", "prompt": "hi", "max_tokens": 1}, timeout=60)
    assert response.status_code in (404, 429), response.text
    return response.status_code


def _bad_token(web: Web) -> int:
    response = httpx.get(f"{web.url}/api/admin/tenants", timeout=60,
                         headers={"Authorization": f"Bearer st-op-{'x' * 43}"})
    assert response.status_code in (401, 429), response.text
    return response.status_code


def _login(client: httpx.Client, web: Web, username: str, password: str) -> int:
    page = client.get(f"{web.url}/ui/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    response = client.post(f"{web.url}/ui/login/", data={"username": username, "password": password,
                                                          "csrfmiddlewaretoken": token},
                           headers={"Referer": f"{web.url}/ui/login/"})
    assert response.status_code in (200, 302, 429), response.status_code
    return response.status_code


def _at_a_minute_start() -> int:
    """Wait, if needed, until at most 20 s of the current minute have passed (the scenario takes well
    under 40 s), so that the requests-per-minute window holds from the first request to the last."""
    into = time.time() % 60
    if into > 20:
        time.sleep(60 - into + 0.1)
    return int(time.time() // 60)


@pytest.mark.parametrize("webs", [1, 2], indirect=True, ids=["embedded", "redis-two-processes"])
def test_limit_and_lockout_state_survives_an_anonymous_flood(webs, victim):
    last = webs[-1]
    minute = _at_a_minute_start()
    served = [_complete(webs[i % len(webs)], victim) for i in range(6)]
    assert served.count(404) == 3 and served.count(429) == 3, served  # one limit over every process
    token = [_bad_token(webs[i % len(webs)]) for i in range(11)]
    assert token[:10] == [401] * 10 and token[10] == 429, token
    with httpx.Client(timeout=60) as operator:
        pair = [_login(operator, webs[i % len(webs)], "admin", "wrong") for i in range(7)]
    assert pair[-1] == 429, pair

    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60) as attacker:
        answers = [_login(attacker, last, f"user-{i}", "guess") for i in range(FLOOD)]
    assert answers.count(429) > FLOOD // 2  # the flood's own source locked itself

    for web in webs:
        assert _complete(web, victim) == 429
        assert _bad_token(web) == 429
        with httpx.Client(timeout=60) as operator:  # the right password is not even checked while locked
            assert _login(operator, web, "admin", VICTIM_PASSWORD) == 429
    assert int(time.time() // 60) == minute, "the scenario outlasted its minute: the window check proves nothing"
