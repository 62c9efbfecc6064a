"""Tenant LoRA adapters in the console (issue 45, item 4): the model's card lists its adapters (name,
tenant or public, rank, digest prefix, created) with a delete control confirmed by typing the adapter's
name, which queues the ``adapter_delete`` job and opens its page; the tenant's page lists its private
adapters only. No replica runs here (``tests/vllm/test_adapters_http.py`` serves adapters)."""

from __future__ import annotations

import re

import pytest

from tests.adapters.lora_files import build_adapter
from tests.ui.test_model_job_token_pages import _audit, _by_alice, _field_errors, _html, _job_id

pytest.importorskip("vllm")
BASE = "lora-base"
DELETE = f"/ui/models/{BASE}/adapters/delete/"


@pytest.fixture
def adapters(db, actor, settings, tmp_path_factory, vllm_checkpoint, monkeypatch):
    """A vLLM deployment with a public adapter and one private to acme; jobs are not run (queued)."""
    from controlplane.adapters.services import adapter_create
    from controlplane.jobs import services
    from controlplane.registry.services import model_create
    from controlplane.tenants.services import tenant_create

    monkeypatch.setattr(services, "_enqueue", lambda job: None)
    settings.STRATA_WEIGHTS_ROOT = tmp_path_factory.getbasetemp()
    root = tmp_path_factory.mktemp("console-adapters")
    build_adapter(root / "a", vllm_checkpoint[1], seed=1)
    build_adapter(root / "b", vllm_checkpoint[1], seed=2)
    deployment = model_create(actor=actor, name=BASE, preset="",
                              revision={"label": "r1", "path": str(vllm_checkpoint[0])}, engine="vllm")
    acme = tenant_create(actor=actor, slug="acme", name="Acme")
    tenant_create(actor=actor, slug="globex", name="Globex")
    public = adapter_create(actor=actor, deployment=deployment, name="tuned-pub", path=str(root / "a"))
    private = adapter_create(actor=actor, deployment=deployment, name="tuned-acme", path=str(root / "b"), tenant=acme)
    return public, private


def _card(page: str) -> str:
    return re.search(rf'<section class="card" id="m-{BASE}".*?</section>', page, re.S)[0]


def test_the_model_card_lists_its_adapters_with_tenant_rank_digest_and_created(admin_ui, viewer_ui, adapters):
    public, private = adapters
    for client in (admin_ui, viewer_ui):
        card = _card(_html(client.get("/ui/models/")))
        rows = re.search(r'aria-label="Adapters of lora-base".*?</table>', card, re.S)[0]
        assert '<th scope="row">tuned-pub</th>' in rows and '<th scope="row">tuned-acme</th>' in rows
        assert '<a href="/ui/tenants/acme/">acme</a>' in rows and "<td>public</td>" in rows
        assert rows.count("<td>8</td>") == 2  # rank
        for a in adapters:
            assert f'<code title="{a.digest}">{a.digest[:12]}</code>' in rows
        assert public.created.strftime("%Y-%m-%d") in rows
    admin_form = re.search(rf'action="{DELETE}".*?</form>', _html(admin_ui.get("/ui/models/")), re.S)[0]
    assert '<option value="tuned-acme">tuned-acme (acme)</option>' in admin_form
    assert '<option value="tuned-pub">tuned-pub (public)</option>' in admin_form
    assert "Type the adapter&#x27;s name to confirm" in admin_form and 'class="danger">Delete adapter' in admin_form
    assert DELETE not in _html(viewer_ui.get("/ui/models/"))  # viewers see no control
    assert viewer_ui.post(DELETE, {"adapter": "tuned-pub", "confirm": "tuned-pub"}).status_code == 403


def test_an_adapter_is_deleted_with_its_name_typed_and_the_job_opens(admin_ui, adapters):
    from controlplane.adapters.models import Adapter
    from controlplane.jobs.models import FlushJob

    wrong = admin_ui.post(DELETE, {"adapter": "tuned-acme", "confirm": "tuned-pub", "reason": "retired"})
    assert wrong.status_code == 422
    assert any("tuned-acme" in e for e in _field_errors(_html(wrong), DELETE, "confirm"))
    missing = admin_ui.post(DELETE, {"adapter": "tuned-none", "confirm": "tuned-none"})
    assert missing.status_code == 404
    assert any("tuned-none" in e for e in _field_errors(_html(missing), DELETE, "adapter"))
    assert not FlushJob.objects.exists() and Adapter.objects.get(name="tuned-acme").state == "live"
    done = admin_ui.post(DELETE, {"adapter": "tuned-acme", "confirm": "tuned-acme", "reason": "retired"})
    job = FlushJob.objects.get(pk=_job_id(done))
    assert (job.kind, job.adapter.name, job.status) == ("adapter_delete", "tuned-acme", "queued")
    assert Adapter.objects.get(name="tuned-acme").state == "deleting"
    live = _html(admin_ui.get(done["Location"]))
    assert f'data-poll="/ui/jobs/{job.pk}/live/"' in live
    _by_alice(_audit("adapter.delete")[-1])
    # it stays listed as deleting until its job is done, and is no longer offered for deletion
    page = _html(admin_ui.get("/ui/models/"))
    assert "status-deleting" in _card(page)
    form = re.search(rf'action="{DELETE}".*?</form>', page, re.S)[0]
    assert 'value="tuned-acme"' not in form and 'value="tuned-pub"' in form


def test_the_tenant_page_lists_its_private_adapters_only(admin_ui, adapters):
    public, private = adapters
    acme = _html(admin_ui.get("/ui/tenants/acme/"))
    section = re.search(r'aria-labelledby="h-adapters".*?</section>', acme, re.S)[0]
    assert '<th scope="row">tuned-acme</th>' in section and f'href="/ui/models/#m-{BASE}"' in section
    assert f"{private.digest[:12]}</code>" in section and "<td>8</td>" in section
    assert "tuned-pub" not in section
    assert 'id="h-adapters"' not in _html(admin_ui.get("/ui/tenants/globex/"))  # none of its own


def test_each_adapter_shows_its_last_day_in_the_ledger_on_the_model_and_tenant_pages(admin_ui, adapters):
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.ledger.services import ledger_record
    from controlplane.tenants.models import Tenant
    from tests.controlplane.test_ledger import usage

    acme, globex = Tenant.objects.get(slug="acme"), Tenant.objects.get(slug="globex")
    ledger_record(tenant_id=acme.pk, model="tuned-acme", usage=usage(1200, 8, l1=640, l2=64, l3=32))
    ledger_record(tenant_id=acme.pk, model="tuned-acme", usage=usage(100, 8))
    ledger_record(tenant_id=acme.pk, model="tuned-pub", usage=usage(70, 4, l1=32))
    ledger_record(tenant_id=globex.pk, model="tuned-pub", usage=usage(70, 4, l2=64))
    ledger_record(tenant_id=acme.pk, model=BASE, usage=usage(5000, 4, l1=4000))  # the base model's own line
    ledger_record(tenant_id=acme.pk, model="tuned-acme", usage=usage(9999, 1, l1=9000),
                  at=timezone.now() - timedelta(days=2))  # older than the day shown

    def row(html: str, name: str) -> list[str]:
        tr = re.search(rf'<th scope="row">{name}</th>(.*?)</tr>', html, re.S)[1]
        return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]

    card = _card(_html(admin_ui.get("/ui/models/")))
    # tenant, rank, digest, created, then requests, prompt tokens, cached L1 · L2 · L3 over every tenant
    assert row(card, "tuned-acme")[4:7] == ["2", "1,300", "640 · 64 · 32"]
    assert row(card, "tuned-pub")[4:7] == ["2", "140", "32 · 64 · 0"]
    section = re.search(r'aria-labelledby="h-adapters".*?</section>', _html(admin_ui.get("/ui/tenants/acme/")), re.S)[0]
    # model, rank, digest, created, then the tenant's own figures
    assert row(section, "tuned-acme")[4:7] == ["2", "1,300", "640 · 64 · 32"]
