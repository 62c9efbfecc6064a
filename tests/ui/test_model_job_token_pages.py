"""Operator UI, issue 10: models (create a deployment, add revisions by seed or weights path, roll
out, each revision's state), jobs (a flush of any scope, every kind listed, per-worker and per-tier
results, verification) and operator tokens (created and shown once, revoked with a confirmation).

Every form through Django's test client: success (through the same services as the admin API,
audited with the operator's name, ``session`` and source), a validation error shown next to its
field, and a viewer refused (403, audited ``auth.denied``, nothing changed)."""

from __future__ import annotations

import hashlib
import re

import pytest
from django.test import Client

pytestmark = pytest.mark.django_db


def _html(response) -> str:
    html = response.content.decode()
    assert response.status_code < 500 and "Traceback" not in html
    return html


def _audit(action: str):
    from controlplane.audit.models import AuditEvent

    return list(AuditEvent.objects.filter(action=action).order_by("seq"))


def _by_alice(event) -> None:
    assert (event.actor, event.auth_method, event.source) == ("alice", "session", "127.0.0.1")


def _field_errors(html: str, action: str, field: str) -> list[str]:
    """The errors shown next to ``field`` (its ``<div class="field">``) in the form posting to ``action``."""
    start = html.index(f'action="{action}"')
    form = html[start:html.index("</form>", start)]
    chunk = next(c for c in form.split('<div class="field')[1:] if f'name="{field}"' in c)
    if not chunk.startswith(" invalid"):
        return []
    return re.findall(r'<small class="error"[^>]*>(.*?)</small>', chunk)


def _job_id(response) -> int:
    match = re.fullmatch(r"/ui/jobs/(\d+)/", response["Location"])
    assert match, response["Location"]
    return int(match.group(1))


@pytest.fixture
def weights(tmp_path, settings):
    root = tmp_path / "weights"
    root.mkdir()
    settings.STRATA_WEIGHTS_ROOT = root.resolve()
    path = root / "model.safetensors"
    path.write_bytes(b"not really safetensors, but a file with a digest")
    return path


# ---------------------------------------------------------------------- models: create
def test_admin_creates_a_model_with_a_seeded_first_revision(admin_ui):
    from controlplane.registry.models import ModelDeployment

    page = _html(admin_ui.get("/ui/models/"))
    assert "Add a model deployment" in page and '<option value="tiny">' in page and '<option value="small">' in page
    response = admin_ui.post("/ui/models/", {"name": "demo", "preset": "tiny", "label": "r1", "seed": "5"})
    assert response.status_code == 302 and response["Location"] == "/ui/models/#m-demo"
    deployment = ModelDeployment.objects.get(name="demo")
    assert (deployment.preset, deployment.active_revision.label, deployment.active_revision.seed) == ("tiny", "r1", 5)
    event = _audit("model.create")[-1]
    _by_alice(event)
    assert event.new_value["revision"]["seed"] == 5
    page = _html(admin_ui.get("/ui/models/"))
    assert "Created model demo" in page and 'id="m-demo"' in page
    assert re.search(r'<th scope="row">r1</th>.*?<span class="badge rev-active"[^>]*>active</span>', page, re.S)


def test_admin_creates_a_model_from_a_weights_file(admin_ui, weights):
    from controlplane.registry.models import ModelDeployment

    response = admin_ui.post("/ui/models/", {"name": "from-file", "preset": "tiny", "label": "v1",
                                              "weights_path": str(weights)})
    assert response.status_code == 302
    revision = ModelDeployment.objects.get(name="from-file").active_revision
    assert revision.seed is None and revision.weights_path == str(weights.resolve())
    assert revision.digest == hashlib.sha256(weights.read_bytes()).hexdigest()
    _by_alice(_audit("model.create")[-1])
    assert str(weights.resolve()) in _html(admin_ui.get("/ui/models/"))


@pytest.mark.parametrize(("data", "status", "field", "error"), [
    ({"name": "bad name!", "preset": "tiny", "label": "r1", "seed": "1"}, 422, "name", "use 1-100 characters"),
    ({"name": "m", "preset": "huge", "label": "r1", "seed": "1"}, 422, "preset", "Select a valid choice"),
    ({"name": "m", "preset": "tiny", "label": "", "seed": "1"}, 422, "label", "This field is required"),
    ({"name": "m", "preset": "tiny", "label": "r1"}, 422, "seed", "give a seed or a weights path"),
    ({"name": "m", "preset": "tiny", "label": "r1", "seed": "-1"}, 422, "seed", "greater than or equal to 0"),
    ({"name": "m", "preset": "tiny", "label": "r1", "seed": "1", "weights_path": "/x"}, 422, "weights_path",
     "not both"),
    ({"name": "m", "preset": "tiny", "label": "r1", "weights_path": "/nowhere/w.safetensors"}, 422, "weights_path",
     "must be inside"),
    ({"name": "tiny-llama", "preset": "tiny", "label": "r1", "seed": "1"}, 409, "name", "already exists"),
])
def test_bad_model_creations_show_the_error_next_to_the_field(admin_ui, model, weights, data, status, field, error):
    from controlplane.registry.models import ModelDeployment

    response = admin_ui.post("/ui/models/", data)
    html = _html(response)
    assert response.status_code == status
    errors = _field_errors(html, "/ui/models/", field)
    assert any(error in e for e in errors), (field, errors)
    assert 'role="alert"' in html  # and summed up at the top
    if data["name"] == "m":
        assert 'value="m"' in html  # the input is kept
    assert list(ModelDeployment.objects.values_list("name", flat=True)) == ["tiny-llama"]
    assert not [e for e in _audit("model.create") if e.actor == "alice"]


# ---------------------------------------------------------------------- models: revisions and states
def test_admin_adds_a_revision_from_a_weights_file(admin_ui, model, weights):
    from controlplane.registry.models import ModelRevision

    response = admin_ui.post("/ui/models/tiny-llama/revisions/", {"label": "w1", "weights_path": str(weights)})
    assert response.status_code == 302 and response["Location"] == "/ui/models/"
    revision = ModelRevision.objects.get(deployment=model, label="w1")
    assert revision.weights_path == str(weights.resolve()) and revision.seed is None
    event = _audit("revision.create")[-1]
    _by_alice(event)
    assert event.target == "tiny-llama@w1" and event.new_value["weights_path"] == str(weights.resolve())
    page = _html(admin_ui.get("/ui/models/"))
    assert re.search(r'<th scope="row">w1</th>.*?rev-staged[^>]*>staged<', page, re.S)


@pytest.mark.parametrize(("data", "status", "field", "error"), [
    ({"label": "r9"}, 422, "seed", "give a seed or a weights path"),
    ({"label": "r9", "seed": "1", "weights_path": "/x"}, 422, "weights_path", "not both"),
    ({"label": "r9", "weights_path": "/nowhere/w.safetensors"}, 422, "weights_path", "must be inside"),
    ({"label": "no spaces!", "seed": "1"}, 422, "label", "use 1-64 characters"),
    ({"label": "r2", "seed": "1"}, 409, "label", "already has a revision"),
])
def test_bad_revisions_show_the_error_next_to_the_field(admin_ui, model, weights, data, status, field, error):
    from controlplane.registry.models import ModelRevision

    action = "/ui/models/tiny-llama/revisions/"
    response = admin_ui.post(action, data)
    html = _html(response)
    assert response.status_code == status
    assert any(error in e for e in _field_errors(html, action, field))
    assert set(ModelRevision.objects.values_list("label", flat=True)) == {"r1", "r2"}


def test_each_revision_shows_its_state_active_staged_rolling_out_or_retired(admin_ui, model, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.jobs.services import rollout_request
    from controlplane.registry.services import model_activate_revision, revision_create

    def state(html: str, label: str) -> str:
        return re.search(rf'<th scope="row">{label}</th>.*?class="badge rev-[a-z-]+"[^>]*>([a-z ]+)<', html, re.S)[1]

    page = _html(admin_ui.get("/ui/models/"))
    assert (state(page, "r1"), state(page, "r2")) == ("active", "staged")
    # r1 -> r2 rolled out (what the job does: switch the active revision, record the step, finish)
    job = rollout_request(actor=actor, model="tiny-llama", revision="r2", reason="new weights")
    model_activate_revision(actor=actor, deployment=model, revision=job.revision)
    FlushJob.objects.filter(pk=job.pk).update(status="succeeded", verified=True,
                                              steps=[*job.steps, {"at": job.steps[0]["at"], "step": "switched"}])
    revision_create(actor=actor, deployment=model, label="r3", seed=9)
    pending = rollout_request(actor=actor, model="tiny-llama", revision="r3")  # queued, not switched yet
    page = _html(admin_ui.get("/ui/models/"))
    assert [state(page, label) for label in ("r1", "r2", "r3")] == ["retired", "active", "rolling out"]
    assert f'href="/ui/jobs/{pending.pk}/"' in page  # the latest rollout, linked to its live page
    assert '<option value="r1">r1 (retired)</option>' in page and '<option value="r2">' not in page
    # r1 is offered only by the separate rollback form; the primary rollout offers only newer revisions
    rollout_form = re.search(r'action="/ui/models/tiny-llama/rollout/".*?</form>', page, re.S)[0]
    assert 'value="r1"' not in rollout_form and 'value="r3"' in rollout_form
    rollback_form = re.search(r'action="/ui/models/tiny-llama/rollback/".*?</form>', page, re.S)[0]
    assert '<option value="r1">r1 (retired)</option>' in rollback_form


def test_a_rollback_is_its_own_confirmed_action(admin_ui, model, actor, admin_client):
    """After r1 -> r2, the primary button defaults to the newest revision and never offers r1; rolling
    back to r1 needs the rollback form (or rollback: true in the API) and the model's name typed."""
    from controlplane.jobs.models import FlushJob
    from controlplane.jobs.services import rollout_request
    from controlplane.registry.services import model_activate_revision, revision_create

    job = rollout_request(actor=actor, model="tiny-llama", revision="r2")
    model_activate_revision(actor=actor, deployment=model, revision=job.revision)
    FlushJob.objects.filter(pk=job.pk).update(status="succeeded")
    revision_create(actor=actor, deployment=model, label="r3", seed=9)
    revision_create(actor=actor, deployment=model, label="r4", seed=10)
    page = _html(admin_ui.get("/ui/models/"))
    rollout_form = re.search(r'action="/ui/models/tiny-llama/rollout/".*?</form>', page, re.S)[0]
    assert re.search(r'<option value="r4" selected>', rollout_form)  # the newest non-active by default
    # the primary action refuses a rollback; the API too, unless asked for as one and confirmed
    refused = admin_ui.post("/ui/models/tiny-llama/rollout/", {"revision": "r1"})
    assert refused.status_code == 409
    for body in ({"revision": "r1"}, {"revision": "r1", "rollback": True},
                 {"revision": "r1", "rollback": True, "confirm": "tiny"}):
        r = admin_client.post("/api/admin/models/tiny-llama/rollout", body, content_type="application/json")
        assert r.status_code == 409 and r.json()["error"]["code"] == "rollback_not_confirmed", body
    wrong = admin_ui.post("/ui/models/tiny-llama/rollback/", {"revision": "r1", "confirm": "tiny-lama"})
    assert wrong.status_code == 409
    assert any("rollback" in e for e in _field_errors(_html(wrong), "/ui/models/tiny-llama/rollback/", "confirm"))
    done = admin_ui.post("/ui/models/tiny-llama/rollback/", {"revision": "r1", "confirm": "tiny-llama"})
    back = FlushJob.objects.get(pk=_job_id(done))
    assert (back.from_revision.label, back.revision.label) == ("r2", "r1")
    assert back.steps[0]["rollback"] is True and back.steps[0]["from"] == "r2" and back.steps[0]["to"] == "r1"
    from controlplane.audit.models import AuditEvent

    assert AuditEvent.objects.filter(action="rollback.request").count() == 1
    # rolling forward needs no confirmation
    ok = admin_client.post("/api/admin/models/tiny-llama/rollout", {"revision": "r4"}, content_type="application/json")
    assert ok.status_code == 202


def test_rollout_button_opens_the_live_job_and_errors_sit_next_to_the_revision(admin_ui, model):
    from controlplane.jobs.models import FlushJob

    action = "/ui/models/tiny-llama/rollout/"
    refused = admin_ui.post(action, {"revision": "r1"})
    assert refused.status_code == 409
    assert any("already active" in e for e in _field_errors(_html(refused), action, "revision"))
    response = admin_ui.post(action, {"revision": "r2", "reason": "new weights"})
    job = FlushJob.objects.get(pk=_job_id(response))
    assert (job.kind, job.from_revision.label, job.revision.label) == ("rollout", "r1", "r2")
    page = _html(admin_ui.get(response["Location"]))
    assert f'data-poll="/ui/jobs/{job.pk}/live/"' in page and "waiting for workers" in page
    _by_alice(_audit("rollout.request")[-1])


# ---------------------------------------------------------------------- jobs: flush of any scope
@pytest.mark.parametrize(("data", "expected"), [
    ({"scope": "tenant", "tenant": "acme"}, ("tenant", "acme", None, None)),
    ({"scope": "model", "model": "tiny-llama"}, ("model", None, "tiny-llama", None)),
    ({"scope": "revision", "model": "tiny-llama", "revision": "r2"}, ("revision", None, "tiny-llama", "r2")),
    ({"scope": "all", "tenant": "acme", "model": "tiny-llama"}, ("all", None, None, None)),  # extras ignored
])
def test_admin_flushes_any_scope_with_a_reason(admin_ui, tenant, model, data, expected):
    from controlplane.jobs.models import FlushJob

    response = admin_ui.post("/ui/jobs/", {**data, "reason": "operator check"})
    assert response.status_code == 302
    job = FlushJob.objects.get(pk=_job_id(response))
    got = (job.scope, job.tenant.slug if job.tenant_id else None, job.deployment.name if job.deployment_id else None,
           job.revision.label if job.revision_id else None)
    assert got == expected and job.reason == "operator check" and job.kind == "flush"
    event = _audit("flush.request")[-1]
    _by_alice(event)
    assert event.target == f"job:{job.pk}" and event.reason == "operator check"


@pytest.mark.parametrize(("data", "status", "field", "error"), [
    ({"scope": "tenant", "reason": "x"}, 422, "tenant", "scope &#x27;tenant&#x27; needs &#x27;tenant&#x27;"),
    ({"scope": "model", "reason": "x"}, 422, "model", "scope &#x27;model&#x27; needs &#x27;model&#x27;"),
    ({"scope": "revision", "reason": "x"}, 422, "model", "needs &#x27;model&#x27;"),
    ({"scope": "revision", "model": "tiny-llama", "reason": "x"}, 422, "revision", "needs &#x27;revision&#x27;"),
    ({"scope": "revision", "model": "tiny-llama", "revision": "r9", "reason": "x"}, 404, "revision",
     "revision &#x27;r9&#x27; not found"),
    ({"scope": "model", "model": "nope", "reason": "x"}, 404, "model", "model &#x27;nope&#x27; not found"),
    ({"scope": "tenant", "tenant": "nobody", "reason": "x"}, 404, "tenant", "tenant &#x27;nobody&#x27; not found"),
    ({"scope": "all", "reason": "  "}, 422, "reason", "This field is required"),
    ({"scope": "planet", "reason": "x"}, 422, "scope", "Select a valid choice"),
])
def test_bad_flushes_show_the_error_next_to_the_field(admin_ui, tenant, model, data, status, field, error):
    from controlplane.jobs.models import FlushJob

    response = admin_ui.post("/ui/jobs/", data)
    html = _html(response)
    assert response.status_code == status
    errors = _field_errors(html, "/ui/jobs/", field)
    assert any(error in e for e in errors), (field, errors)
    assert not FlushJob.objects.exists()


# ---------------------------------------------------------------------- jobs: every kind, results per tier
@pytest.fixture
def every_kind(tenant, model, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.jobs.services import flush_job_request, rollout_request

    jobs = {
        "flush": flush_job_request(actor=actor, scope="all", reason="weekly"),
        "rollout": rollout_request(actor=actor, model="tiny-llama", revision="r2"),
    }
    for kind, version in (("offboard", None), ("shred", 1)):
        jobs[kind] = FlushJob.objects.create(kind=kind, scope="tenant", tenant=tenant, key_version=version,
                                             reason=f"{kind} acme", requested_by="tests")
    return jobs


def test_jobs_page_lists_every_kind_live_and_filters_by_kind(viewer_ui, every_kind):
    page = _html(viewer_ui.get("/ui/jobs/"))
    assert 'data-poll="/ui/jobs/live/"' in page
    for kind, job in every_kind.items():
        assert f'href="/ui/jobs/{job.pk}/"' in page and f"kind-{kind}" in page
    assert "tenant acme, data key v1" in page and "tiny-llama: r1 → r2" in page
    shreds = _html(viewer_ui.get("/ui/jobs/?kind=shred"))
    assert 'data-poll="/ui/jobs/live/?kind=shred"' in shreds and 'aria-current="page">shred<' in shreds
    assert f'href="/ui/jobs/{every_kind["shred"].pk}/"' in shreds
    assert f'href="/ui/jobs/{every_kind["flush"].pk}/"' not in shreds
    live = _html(viewer_ui.get("/ui/jobs/live/?kind=rollout"))
    assert f"#{every_kind['rollout'].pk}" in live and f"#{every_kind['flush'].pk}<" not in live
    assert "<html" not in live
    unknown = viewer_ui.get("/ui/jobs/?kind=bogus")  # an unknown kind shows them all
    assert f'href="/ui/jobs/{every_kind["offboard"].pk}/"' in _html(unknown)


def test_the_jobs_table_scrolls_in_its_own_box_and_lets_long_cells_wrap(viewer_ui, every_kind):
    """The table sits in a sideways-scrolling box (never the page); the target and the requester may
    wrap, the date may not (tests/ui/test_layout_browser.py checks the widths in a browser)."""
    for url in ("/ui/jobs/", "/ui/jobs/live/"):
        html = _html(viewer_ui.get(url))
        assert '<div class="scroll"><table class="jobs">' in html and html.count("</table></div>") == 1
        assert html.count('<td class="target">') == len(every_kind)
        assert html.count('<td class="requested"><span class="nowrap">') == len(every_kind)


def test_a_flush_job_shows_per_worker_and_per_tier_results_steps_and_verification(viewer_ui, model, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.jobs.services import flush_job_request

    job = flush_job_request(actor=actor, scope="model", model="tiny-llama", reason="refresh")
    steps = [*job.steps, {"at": job.steps[0]["at"], "step": "verified"},
             {"at": job.steps[0]["at"], "step": "finished", "status": "partial", "verified": False}]
    FlushJob.objects.filter(pk=job.pk).update(
        status="partial", verified=False, progress_done=1, progress_total=2, attempts=3, steps=steps,
        results={"cache-worker:tiny-llama:0": {"status": "ok", "blocks_freed": 5, "tokens_dropped": 80,
                                               "tiers": {"l1": 3, "l2": 2, "l3": 4}, "l3_bytes": 4096,
                                               "bytes": 1024 * 1024 + 4096, "seconds": 0.01},
                 "cache-worker:tiny-llama:1": {"status": "failed", "reason": "unreachable"}})
    page = _html(viewer_ui.get(f"/ui/jobs/{job.pk}/"))
    rows = re.findall(r"<tr>\s*<th scope=\"row\"><code class=\"nowrap\">(.*?)</code></th>(.*?)</tr>", page, re.S)
    cells = {worker: re.findall(r"<td[^>]*>(.*?)</td>", body, re.S) for worker, body in rows}
    ok = cells["cache-worker:tiny-llama:0"]
    assert ok[0] == "flush" and "ok" in ok[1] and ok[2:7] == ["5", "3", "2", "4", "1.0 MiB"]
    assert "tokens_dropped=80" in ok[7] and "l3_bytes" not in ok[7]
    failed = cells["cache-worker:tiny-llama:1"]
    assert "failed" in failed[1] and "unreachable" in failed[7] and failed[2:6] == ["—"] * 4
    assert "1 / 2 workers" in page and "not verified" in page and "Verification" in page
    assert re.search(r"<tfoot>.*?Total.*?>5<.*?>3<.*?>2<.*?>4<.*?1\.0 MiB", page, re.S)
    assert 'id="h-verification"' in page and "<strong>verified</strong>" in page  # the verify step, listed


def test_shred_and_rollout_jobs_show_their_steps_per_worker(viewer_ui, tenant, model, actor):
    from controlplane.jobs.models import FlushJob
    from controlplane.jobs.services import rollout_request

    shred = FlushJob.objects.create(
        kind="shred", scope="tenant", tenant=tenant, key_version=2, reason="leaked", requested_by="alice",
        status="succeeded", verified=True, progress_done=1, progress_total=1,
        results={"cache-worker:tiny-llama:0:drop:v2": {"status": "ok", "objects": 3, "bytes": 2048}},
        steps=[{"at": "2025-01-01T00:00:00+00:00", "step": "keys_verified", "versions": [2]}])
    page = _html(viewer_ui.get(f"/ui/jobs/{shred.pk}/"))
    assert "tenant acme, data key v2" in page and "drop key v2" in page and "2.0 KiB" in page
    assert re.search(r"drop key v2</td>.*?<td class=\"count\">3</td>", page, re.S)
    assert "verified: no object under the shredded key is left anywhere" in page
    assert "keys_verified" in page.split('id="h-verification"')[1]

    rollout = rollout_request(actor=actor, model="tiny-llama", revision="r2")
    FlushJob.objects.filter(pk=rollout.pk).update(status="running", progress_done=1, progress_total=2, results={
        "cache-worker:tiny-llama:0:stage": {"status": "ok", "revision": "r2", "weight_digest": "ab" * 32}})
    page = _html(viewer_ui.get(f"/ui/jobs/{rollout.pk}/"))
    assert "1 / 2 worker steps" in page and ">stage</td>" in page and "pending" in page
    assert f'data-poll="/ui/jobs/{rollout.pk}/live/"' in page


# ---------------------------------------------------------------------- operator tokens
def _nonce(html: str) -> str:
    return re.search(r'name="nonce" value="([^"]+)"', html)[1]


def test_admin_creates_a_token_shown_once_never_stored_and_never_on_a_get(admin_ui):
    from controlplane.operators.models import OperatorToken
    from controlplane.operators.selectors import operator_authenticate

    page = _html(admin_ui.get("/ui/tokens/"))
    assert 'href="/ui/tokens/"' in page and "Create a token" in page  # the nav link, and the form
    data = {"username": "ci-bot", "role": "viewer", "nonce": _nonce(page)}
    response = admin_ui.post("/ui/tokens/", data)
    assert response.status_code == 200 and response["Cache-Control"] == "no-store"
    html = _html(response)
    raw = re.search(r'id="new-token"[^>]*value="([^"]+)"', html)[1]
    token = OperatorToken.objects.get()
    assert operator_authenticate(raw) == token and (token.username, token.role) == ("ci-bot", "viewer")
    assert raw.startswith(token.prefix) and "shown only this once" in html
    assert Client(headers={"Authorization": f"Bearer {raw}"}).get("/api/admin/models").status_code == 200
    event = _audit("operator_token.create")[-1]
    _by_alice(event)
    assert event.new_value["username"] == "ci-bot" and event.target == token.prefix
    assert raw not in str(event.new_value) and token.token_hash != raw  # never stored
    assert raw not in str(dict(admin_ui.session))

    # A reload re-sends the POST: no second token, and the first is not shown again.
    again = admin_ui.post("/ui/tokens/", data)
    assert again.status_code == 302 and again["Location"] == "/ui/tokens/"
    assert OperatorToken.objects.count() == 1 and raw not in _html(again)
    listing = _html(admin_ui.get("/ui/tokens/"))
    assert "already sent" in listing and raw not in listing and token.prefix in listing and "ci-bot" in listing
    assert token.token_hash not in listing
    forged = admin_ui.post("/ui/tokens/", {"username": "x", "role": "admin"})  # no nonce: refused
    assert forged.status_code == 302 and OperatorToken.objects.count() == 1


@pytest.mark.parametrize(("data", "field", "error"), [
    ({"username": "", "role": "admin"}, "username", "This field is required"),
    ({"username": "   ", "role": "admin"}, "username", "This field is required"),
    ({"username": "u" * 151, "role": "admin"}, "username", "at most 150 characters"),
    ({"username": "ops", "role": "root"}, "role", "Select a valid choice"),
])
def test_bad_tokens_show_the_error_next_to_the_field(admin_ui, data, field, error):
    from controlplane.operators.models import OperatorToken

    nonce = _nonce(_html(admin_ui.get("/ui/tokens/")))
    response = admin_ui.post("/ui/tokens/", {**data, "nonce": nonce})
    html = _html(response)
    assert response.status_code == 422
    assert any(error in e for e in _field_errors(html, "/ui/tokens/", field))
    assert not OperatorToken.objects.exists() and 'id="new-token"' not in html
    fresh = _nonce(html)  # the form can be sent again as it is
    assert fresh != nonce
    assert admin_ui.post("/ui/tokens/", {"username": "ops", "role": "admin", "nonce": fresh}).status_code == 200


def test_admin_revokes_a_token_after_confirming(admin_ui, actor):
    from controlplane.operators.selectors import operator_authenticate
    from controlplane.operators.services import operator_token_create

    token, raw = operator_token_create(actor=actor, username="old-bot", role="admin")
    page = _html(admin_ui.get("/ui/tokens/"))
    assert f'href="/ui/tokens/{token.pk}/revoke/"' in page and "live" in page
    confirm = _html(admin_ui.get(f"/ui/tokens/{token.pk}/revoke/"))
    assert "Revoke token" in confirm and "lose access" in confirm and 'name="confirm" value="yes"' in confirm
    unconfirmed = admin_ui.post(f"/ui/tokens/{token.pk}/revoke/", {})
    assert unconfirmed.status_code == 422 and "was not revoked" in _html(unconfirmed)
    assert operator_authenticate(raw) == token
    response = admin_ui.post(f"/ui/tokens/{token.pk}/revoke/", {"confirm": "yes"})
    assert response.status_code == 302 and response["Location"] == "/ui/tokens/"
    token.refresh_from_db()
    assert token.revoked_at is not None and operator_authenticate(raw) is None
    event = _audit("operator_token.revoke")[-1]
    _by_alice(event)
    assert event.target == token.prefix
    listing = _html(admin_ui.get("/ui/tokens/"))
    assert "Revoked token" in listing and "revoked" in listing
    assert f'href="/ui/tokens/{token.pk}/revoke/"' not in listing
    assert admin_ui.get(f"/ui/tokens/{token.pk}/revoke/").status_code == 302  # already revoked
    missing = admin_ui.post("/ui/tokens/424242/revoke/", {"confirm": "yes"})
    assert missing.status_code == 404 and "operator token 424242 not found" in _html(missing)


def test_viewer_sees_the_tokens_but_no_controls(viewer_ui, actor):
    from controlplane.operators.services import operator_token_create

    token, raw = operator_token_create(actor=actor, username="ci-bot", role="viewer")
    for url in ("/ui/tokens/", f"/ui/tokens/{token.pk}/revoke/"):
        html = _html(viewer_ui.get(url))
        assert token.prefix in html and "ci-bot" in html and "never" in html
        assert raw not in html and token.token_hash not in html
        assert "Create token" not in html and "Revoke" not in html and 'name="nonce"' not in html
        assert html.count('method="post"') == 1  # the log-out button only


# ---------------------------------------------------------------------- viewers
def test_viewer_reads_the_models_and_jobs_pages_without_controls(viewer_ui, tenant, model):
    for url in ("/ui/models/", "/ui/jobs/"):
        html = _html(viewer_ui.get(url))
        assert "tiny-llama" in html or "Recent jobs" in html
        assert html.count('method="post"') == 1 and "Create model" not in html
    assert "staged" in _html(viewer_ui.get("/ui/models/"))


def test_viewer_posts_are_refused_audited_and_change_nothing(viewer_ui, tenant, model, actor, weights):
    from controlplane.jobs.models import FlushJob
    from controlplane.operators.models import OperatorToken
    from controlplane.operators.services import operator_token_create
    from controlplane.registry.models import ModelDeployment, ModelRevision

    token, _ = operator_token_create(actor=actor, username="ci-bot", role="viewer")
    attempts = [
        ("/ui/models/", {"name": "m2", "preset": "tiny", "label": "r1", "seed": "1"}),
        ("/ui/models/tiny-llama/revisions/", {"label": "w1", "weights_path": str(weights)}),
        ("/ui/models/tiny-llama/rollout/", {"revision": "r2"}),
        ("/ui/jobs/", {"scope": "revision", "model": "tiny-llama", "revision": "r1", "reason": "x"}),
        ("/ui/tokens/", {"username": "me", "role": "admin", "nonce": "x"}),
        (f"/ui/tokens/{token.pk}/revoke/", {"confirm": "yes"}),
    ]
    for url, data in attempts:
        response = viewer_ui.post(url, data)
        assert response.status_code == 403 and "may only read" in _html(response), url
    assert list(ModelDeployment.objects.values_list("name", flat=True)) == ["tiny-llama"]
    assert set(ModelRevision.objects.values_list("label", flat=True)) == {"r1", "r2"}
    assert not FlushJob.objects.exists() and OperatorToken.objects.count() == 1
    token.refresh_from_db()
    assert token.revoked_at is None
    denied = _audit("auth.denied")
    assert [e.target for e in denied] == [f"POST {url}" for url, _ in attempts]
    assert {(e.actor, e.auth_method, e.source, e.result) for e in denied} == {
        ("victor", "session", "127.0.0.1", "denied")}
