"""Small helpers for control-plane tests."""

import json

JSON = "application/json"


def post(client, url, data=None, **extra):
    return client.post(url, data=json.dumps(data) if data is not None else "", content_type=JSON, **extra)


def patch(client, url, data, **extra):
    return client.patch(url, data=json.dumps(data), content_type=JSON, **extra)


def audit_actions() -> list[str]:
    from controlplane.audit.models import AuditEvent

    return list(AuditEvent.objects.order_by("seq").values_list("action", flat=True))


def audit_events(action: str) -> list:
    """The events of one action, oldest first."""
    from controlplane.audit.models import AuditEvent

    return list(AuditEvent.objects.filter(action=action).order_by("seq"))


def assert_error(response, status: int, code: str | None = None) -> dict:
    """The response has ``status`` and the Strata error shape; returns the inner error object."""
    assert response.status_code == status, (response.status_code, response.content[:300])
    assert response["Content-Type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in response.content.decode()
    if code is not None:
        assert error["code"] == code, error
    return error
