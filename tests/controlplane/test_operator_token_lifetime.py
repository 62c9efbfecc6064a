"""Operator tokens' lifetime over HTTP: an expiry (the default setting, or per token), last use
recorded at most once a minute, and a revoked or expired token answered 401 with its own code."""

import io
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from tests.controlplane.helpers import assert_error, audit_events

pytestmark = pytest.mark.django_db
URL = "/api/admin/tenants"


def _create(actor, **kwargs):
    from controlplane.operators.services import operator_token_create

    return operator_token_create(actor=actor, username="ops", role="viewer", **kwargs)


def _bearer(raw: str) -> Client:
    return Client(headers={"Authorization": f"Bearer {raw}"})


def test_a_token_expires_after_the_default_days_unless_told_otherwise(actor, settings):
    settings.STRATA_OPERATOR_TOKEN_DAYS = 7
    before = timezone.now()
    token, _ = _create(actor)
    assert before + timedelta(days=7) <= token.expires_at <= timezone.now() + timedelta(days=7)
    short, _ = _create(actor, expires_days=2)
    assert short.expires_at < before + timedelta(days=3)
    assert audit_events("operator_token.create")[-1].new_value["expires_at"].startswith(
        short.expires_at.strftime("%Y-%m-%dT%H:%M"))


@pytest.mark.parametrize("days", [0, -1, 3651, True, "9"])
def test_an_expiry_out_of_range_is_refused(actor, days):
    from controlplane.common.errors import InvalidInput
    from controlplane.operators.models import OperatorToken

    with pytest.raises(InvalidInput, match="expires_days"):
        _create(actor, expires_days=days)
    assert not OperatorToken.objects.exists()


def test_create_operator_token_takes_expires_days():
    from controlplane.operators.models import OperatorToken

    out = io.StringIO()
    call_command("create_operator_token", "--username", "ci", "--role", "admin", "--expires-days", "3", stdout=out)
    token = OperatorToken.objects.get()
    assert timezone.now() + timedelta(days=2) < token.expires_at < timezone.now() + timedelta(days=3, minutes=1)
    assert "expires" in out.getvalue().splitlines()[0]
    with pytest.raises(CommandError, match="expires_days"):
        call_command("create_operator_token", "--username", "ci", "--role", "admin", "--expires-days", "0",
                     stdout=io.StringIO())


def test_an_expired_token_is_401_token_expired_and_audited(actor):
    from controlplane.operators.models import OperatorToken

    token, raw = _create(actor, expires_days=1)
    assert _bearer(raw).get(URL).status_code == 200
    OperatorToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    response = _bearer(raw).get(URL)
    error = assert_error(response, 401, "token_expired")
    assert "expired" in error["message"] and response["WWW-Authenticate"] == "Bearer"
    failed = audit_events("auth.failed")[-1]
    assert failed.actor == f"token:{token.prefix}" and "expired" in failed.reason
    # The other checks that take operator tokens refuse it as well.
    assert_error(_bearer(raw).get("/metrics"), 401, "token_expired")
    assert "checks" not in _bearer(raw).get("/readyz").json()


def test_a_revoked_token_is_401_token_revoked_and_an_unknown_one_plain_401(actor):
    from controlplane.operators.services import operator_token_revoke

    token, raw = _create(actor)
    operator_token_revoke(actor=actor, token=token)
    assert_error(_bearer(raw).get(URL), 401, "token_revoked")
    assert_error(_bearer(raw[:-4] + "AAAA").get(URL), 401, "unauthenticated")


def test_last_use_is_recorded_at_most_once_a_minute(actor):
    from controlplane.operators.models import OperatorToken

    token, raw = _create(actor)
    assert token.last_used is None
    client = _bearer(raw)
    assert client.get(URL).status_code == 200
    first = OperatorToken.objects.get(pk=token.pk).last_used
    assert first is not None
    assert client.get(URL).status_code == 200
    assert OperatorToken.objects.get(pk=token.pk).last_used == first  # within the minute: not rewritten
    old = timezone.now() - timedelta(minutes=2)
    OperatorToken.objects.filter(pk=token.pk).update(last_used=old)
    assert client.get(URL).status_code == 200
    assert OperatorToken.objects.get(pk=token.pk).last_used > old  # a minute later: written again
