"""The console's Stop / Start control next to a model's replica count (issue 44, item 2) and its
replicas' states: Stop posts 0 through the scaling form (audited ``model.scale``), the page then says
stopped and offers Start (1); viewers see the states but no control."""

from __future__ import annotations

import pytest


@pytest.fixture
def scaled(monkeypatch):
    from controlplane.audit import services as audit_services
    from controlplane.runtime import gateway

    # The test runs on-commit hooks inside a transaction that is rolled back afterwards: the audit's
    # hook would write the rolled-back events' heads to the head log, and the next test's chain would
    # no longer verify against it.
    monkeypatch.setattr(audit_services, "head_log_append_quietly", lambda **kw: None)
    calls = []
    monkeypatch.setattr(gateway, "apply_scale", lambda spec, wait=False: calls.append(spec.replicas))
    return calls


@pytest.fixture
def deployment(db, actor):
    from controlplane.registry.services import model_create

    return model_create(actor=actor, name="console-m", preset="tiny", revision={"label": "r1", "seed": 4})


def test_stop_then_start_from_the_console(admin_ui, deployment, scaled, django_capture_on_commit_callbacks):
    from controlplane.audit.models import AuditEvent

    page = admin_ui.get("/ui/models/").content.decode()
    assert 'aria-label="Stop console-m"' in page and "<strong>stopped</strong>" not in page
    with django_capture_on_commit_callbacks(execute=True):
        stop = admin_ui.post("/ui/models/console-m/replicas/", {"replicas": "0", "reason": "stopped from the console"})
    assert stop.status_code == 302 and scaled == [0]
    page = admin_ui.get("/ui/models/").content.decode()
    assert "<strong>stopped</strong>" in page and 'aria-label="Start console-m"' in page
    assert 'name="replicas" value="1"' in page
    with django_capture_on_commit_callbacks(execute=True):
        start = admin_ui.post("/ui/models/console-m/replicas/", {"replicas": "1"})
    assert start.status_code == 302 and scaled == [0, 1]
    events = AuditEvent.objects.filter(action="model.scale", target="console-m").order_by("seq")
    assert [(e.old_value, e.new_value) for e in events] == [({"replicas": 1}, {"replicas": 0}),
                                                            ({"replicas": 0}, {"replicas": 1})]


def test_the_page_shows_each_replicas_state_and_viewers_get_no_control(viewer_ui, deployment, monkeypatch):
    from controlplane.ui import model_views

    monkeypatch.setattr(model_views, "replica_states", lambda name, replicas: [
        {"replica": 0, "name": f"cache-worker:{name}:0", "state": "starting", "elapsed_s": 12.5,
         "phase": "loading weights"},
        {"replica": 1, "name": f"cache-worker:{name}:1", "state": "failed", "error": "OSError: no such file"}])
    page = viewer_ui.get("/ui/models/").content.decode()
    assert "status-starting" in page and "12.5 s" in page and "loading weights" in page
    assert "status-failed" in page and "OSError: no such file" in page
    assert 'aria-label="Stop console-m"' not in page
    assert viewer_ui.post("/ui/models/console-m/replicas/", {"replicas": "0"}).status_code == 403
