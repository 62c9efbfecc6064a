"""Per-adapter figures (issue 45, item 4), over HTTP against the live server on a vLLM replica with the
suite's local Ray: requests on a LoRA adapter are a line of their own, apart from the base model's, in
the tenant's ledger (requests, tokens, cached tokens by tier) and in ``/metrics`` (the adapter's name as
the ``model`` label of the ledger and serving series, ``strata_adapter_info`` naming its base model)."""

from __future__ import annotations

import pytest

from tests.adapters.lora_files import build_adapter
from tests.controlplane.helpers import post
from tests.vllm.test_vllm_platform import _grant, _kill

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow
NAME = "vllm-lora-figures"
PROMPT = [5 + (i * 7) % 290 for i in range(70)]  # two full blocks of vLLM's CPU build (32)


def _line(text: str, name: str, **labels: str) -> float | None:
    """The value of ``name``'s sample whose labels include ``labels``, None when there is none."""
    for row in text.splitlines():
        if row.startswith(name + "{") and all(f'{k}="{v}"' in row for k, v in labels.items()):
            return float(row.rsplit(" ", 1)[1])
    return None


def test_an_adapter_is_its_own_line_in_the_ledger_and_metrics(platform, admin_client, actor, vllm_checkpoint,
                                                              tmp_path_factory, settings):
    from controlplane.registry.services import model_create

    path, hf, _ = vllm_checkpoint
    settings.STRATA_WEIGHTS_ROOT = tmp_path_factory.getbasetemp()
    root = tmp_path_factory.mktemp("lora-figures")
    build_adapter(root / "a", hf, seed=31)
    d = model_create(actor=actor, name=NAME, preset="", engine="vllm", revision={"label": "r1", "path": str(path)})
    _grant(platform, actor, d, "acme")
    resp = post(admin_client, f"/api/admin/models/{NAME}/adapters", {"name": "fig-a", "path": str(root / "a"),
                                                                     "tenant": "acme"})
    assert resp.status_code == 201, resp.content
    acme = platform.client("acme")
    try:
        cached = [acme.completions.create(model=m, prompt=PROMPT, max_tokens=4, temperature=0)
                  .usage.prompt_tokens_details.cached_tokens for m in ("fig-a", "fig-a", NAME)]
        assert cached == [0, 64, 0]  # A hits its own prefix; the base model does not reach it

        rows = {r["model"]: r for r in admin_client.get("/api/admin/tenants/acme/ledger").json()["rows"]}
        assert set(rows) == {"fig-a", NAME}
        a, base = rows["fig-a"], rows[NAME]
        assert (a["requests"], a["prompt_tokens"], a["completion_tokens"]) == (2, 140, 8)
        assert a["cached_tokens"] == 64 == a["cached_l1"] + a["cached_l2"] + a["cached_l3"]
        assert (base["requests"], base["prompt_tokens"], base["cached_tokens"]) == (1, 70, 0)
        only = admin_client.get("/api/admin/tenants/acme/ledger?model=fig-a").json()
        assert [r["model"] for r in only["rows"]] == ["fig-a"] and only["totals"]["cached_tokens"] == 64

        text = admin_client.get("/metrics").content.decode()
        assert _line(text, "strata_adapter_info", adapter="fig-a", model=NAME, tenant="acme") == 1.0
        assert _line(text, "strata_ledger_tokens_total", tenant="acme", model="fig-a", kind="prompt") == 140.0
        tiers = [_line(text, "strata_ledger_tokens_total", tenant="acme", model="fig-a", kind=f"cached_l{i}")
                 for i in (1, 2, 3)]
        assert sum(tiers) == 64.0
        assert _line(text, "strata_ledger_tokens_total", tenant="acme", model=NAME, kind="prompt") == 70.0
        assert _line(text, "strata_tenant_requests_total", tenant="acme", model="fig-a", outcome="ok") == 2.0
        assert _line(text, "strata_tenant_requests_total", tenant="acme", model=NAME, outcome="ok") == 1.0
    finally:
        _kill(NAME)
