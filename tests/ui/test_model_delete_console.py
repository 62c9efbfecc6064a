"""The console's delete controls (issue 44, item 1): "Delete model" and "Delete revision" on each model,
confirmed by typing the model's name exactly as a rollback is; a wrong name is refused next to the
field and changes nothing, the right one queues the job and opens its live page."""

from __future__ import annotations

import re

import pytest

from tests.ui.test_model_job_token_pages import _audit, _by_alice, _field_errors, _html, _job_id

DELETE = "/ui/models/tiny-llama/delete/"
DELETE_REVISION = "/ui/models/tiny-llama/revisions/delete/"


@pytest.fixture
def queued(monkeypatch):
    from controlplane.jobs import services

    sent: list[int] = []
    monkeypatch.setattr(services, "_enqueue", lambda job: sent.append(job.pk))
    return sent


def _form(page: str, action: str) -> str:
    return re.search(rf'action="{re.escape(action)}".*?</form>', page, re.S)[0]


def test_each_model_has_delete_controls_that_offer_only_inactive_revisions(admin_ui, viewer_ui, model):
    page = _html(admin_ui.get("/ui/models/"))
    model_form = _form(page, DELETE)
    assert 'name="confirm"' in model_form and "Type the model&#x27;s name to confirm" in model_form
    assert 'class="danger">Delete model</button>' in model_form
    revision_form = _form(page, DELETE_REVISION)
    assert '<option value="r2">r2 (staged)</option>' in revision_form and 'value="r1"' not in revision_form
    assert DELETE not in _html(viewer_ui.get("/ui/models/"))  # viewers see no control
    assert viewer_ui.post(DELETE, {"confirm": "tiny-llama", "reason": "x"}).status_code == 403


def test_a_wrong_name_is_refused_and_the_right_one_queues_the_delete_job(admin_ui, model, queued):
    from controlplane.jobs.models import FlushJob
    from controlplane.registry.models import ModelDeployment

    wrong = admin_ui.post(DELETE, {"confirm": "tiny-lama", "reason": "retired"})
    assert wrong.status_code == 409
    assert any("tiny-llama" in e for e in _field_errors(_html(wrong), DELETE, "confirm"))
    assert ModelDeployment.objects.filter(name="tiny-llama").exists() and not FlushJob.objects.exists()
    no_reason = admin_ui.post(DELETE, {"confirm": "tiny-llama", "reason": ""})
    assert no_reason.status_code == 422 and not FlushJob.objects.exists()
    done = admin_ui.post(DELETE, {"confirm": "tiny-llama", "reason": "retired"})
    job = FlushJob.objects.get(pk=_job_id(done))
    assert (job.kind, job.deployment_id, job.status) == ("model_delete", model.pk, "queued") and queued == [job.pk]
    live = _html(admin_ui.get(done["Location"]))
    assert f'data-poll="/ui/jobs/{job.pk}/live/"' in live and "model tiny-llama" in live
    assert 'id="m-tiny-llama"' not in _html(admin_ui.get("/ui/models/"))  # gone from the page at once
    _by_alice(_audit("model.delete")[-1])
    _by_alice(_audit("model_delete.request")[-1])
    assert admin_ui.post(DELETE, {"confirm": "tiny-llama", "reason": "again"}).status_code == 404


def test_a_revision_is_deleted_with_the_models_name_typed_never_the_active_one(admin_ui, model, queued):
    from controlplane.jobs.models import FlushJob

    wrong = admin_ui.post(DELETE_REVISION, {"revision": "r2", "confirm": "r2", "reason": "bad weights"})
    assert wrong.status_code == 409
    assert any("tiny-llama" in e for e in _field_errors(_html(wrong), DELETE_REVISION, "confirm"))
    active = admin_ui.post(DELETE_REVISION, {"revision": "r1", "confirm": "tiny-llama", "reason": "bad weights"})
    assert active.status_code == 409
    assert any("active" in e for e in _field_errors(_html(active), DELETE_REVISION, "revision"))
    assert not FlushJob.objects.exists()
    done = admin_ui.post(DELETE_REVISION, {"revision": "r2", "confirm": "tiny-llama", "reason": "bad weights"})
    job = FlushJob.objects.get(pk=_job_id(done))
    assert (job.kind, job.revision.label) == ("revision_delete", "r2") and queued == [job.pk]
    page = _html(admin_ui.get("/ui/models/"))
    assert DELETE_REVISION not in page  # no inactive revision is left to delete
    assert "<th scope=\"row\">r2</th>" not in page
    _by_alice(_audit("revision.delete")[-1])
