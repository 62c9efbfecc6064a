"""The supervisor's restarts reach operators: ``/readyz``'s operator details and the console's dashboard
show ``$STRATA_HOME/processes.json`` (written by ``workers.process_status``, as ``make run`` writes it);
anonymous callers learn nothing of it; no status file (not under ``make run``) shows nothing; a corrupt
one is no status, never a 500; a restarting child is information, not a readiness failure."""

from __future__ import annotations

import re
import signal
import time

import pytest

from workers import process_status

pytestmark = pytest.mark.django_db


@pytest.fixture
def home(settings, tmp_path, monkeypatch):
    from controlplane import runtime

    monkeypatch.setattr(runtime, "workers_ready", lambda: {"ok": True, "nodes": 1})
    settings.STRATA_HOME = tmp_path
    return tmp_path


def _write(home, celery_state: str = "running") -> None:
    killed = process_status.exit_info(-signal.SIGKILL, time.time())
    process_status.write(process_status.path_in(home), [
        {"name": "ray-head", "state": "running", "pid": 11, "restarts": 0, "started": "2026-12-02T09:00:00Z",
         "last_exit": None, "last_restart": None, "next_start_in_s": None},
        {"name": "celery", "state": celery_state, "pid": 12 if celery_state == "running" else None, "restarts": 2,
         "started": "2026-12-02T09:10:00Z", "last_exit": killed, "last_restart": "2026-12-02T09:10:00Z",
         "next_start_in_s": None if celery_state == "running" else 4.0},
    ])


def test_readyz_shows_operators_each_childs_restarts_and_last_exit(admin_client, client, home):
    _write(home)
    body = admin_client.get("/readyz").json()
    assert body["status"] == "ok"
    celery = {c["name"]: c for c in body["processes"]["children"]}["celery"]
    assert celery["restarts"] == 2 and celery["last_exit"]["signal"] == "SIGKILL"
    assert celery["last_restart"] == "2026-12-02T09:10:00Z" and body["processes"]["running"] is True
    assert client.get("/readyz").json() == {"status": "ok"}  # anonymous: ok / not ok only


def test_a_restarting_child_is_shown_but_readiness_is_what_the_checks_say(admin_client, home):
    _write(home, celery_state="restarting")
    response = admin_client.get("/readyz")
    assert response.status_code == 200
    assert {c["name"]: c for c in response.json()["processes"]["children"]}["celery"]["state"] == "restarting"


@pytest.mark.parametrize("content", [None, "{not json", '{"children": "no"}', "[]"])
def test_no_or_a_corrupt_status_file_shows_no_processes_and_never_fails(admin_client, viewer_ui, home, content):
    if content is not None:
        process_status.path_in(home).write_text(content)
    response = admin_client.get("/readyz")
    assert response.status_code == 200 and "processes" not in response.json()
    page = viewer_ui.get("/ui/")
    assert page.status_code == 200 and b"h-processes" not in page.content


@pytest.mark.parametrize("url", ["/ui/", "/ui/live/"])
def test_the_dashboard_shows_the_processes_their_state_and_restarts(viewer_ui, home, url):
    _write(home, celery_state="restarting")
    html = viewer_ui.get(url).content.decode()
    row = re.search(r'<tr id="process-celery">(.*?)</tr>', html, re.S)
    assert row, html
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", row.group(1)))
    assert "restarting" in text and "next start in 4.0 s" in text and " 2 " in text
    assert "SIGKILL" in text and "2026-12-02T09:10:00Z" in text
    assert '<tr id="process-ray-head">' in html and "supervisor not running" not in html
