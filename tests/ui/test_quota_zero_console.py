"""The console refuses a zero concurrency or in-flight quota with a clear message next to the field
(422), like the admin API: zero would let the tenant run nothing, which suspending it is for."""

from __future__ import annotations

import pytest

from tests.ui.test_tenant_pages import _field_errors, _html, _settings


@pytest.mark.parametrize("quota", ["max_concurrent_requests", "max_inflight_tokens"])
def test_a_zero_quota_is_refused_on_the_settings_form(admin_ui, tenant, quota):
    from controlplane.audit.models import AuditEvent

    response = admin_ui.post("/ui/tenants/acme/settings/", _settings(tenant, **{quota: 0}))
    assert response.status_code == 422
    errors = _field_errors(_html(response), quota, "settings")
    assert any("greater than or equal to 1" in e and "suspend it instead" in e for e in errors), errors
    tenant.refresh_from_db()
    assert getattr(tenant, quota) is None and not AuditEvent.objects.filter(action="tenant.quotas").exists()
