"""The operator login form of the UI and of the Django admin: staff only, throttled and audited.

``clean`` asks ``authguard`` first: while the (account, source) pair or the source is locked it refuses without
checking the password and sets ``retry_after`` (the views answer 429 with the lockout page).
Otherwise Django's ``AdminAuthenticationForm`` checks the password and the staff flag; a failure
is counted and audited (aggregated, naming the account tried and the source), a success is audited
as ``auth.login``.
"""

from __future__ import annotations

from django.contrib.admin.forms import AdminAuthenticationForm
from django.core.exceptions import ValidationError

from controlplane.common.sources import RequestSource, request_source
from controlplane.operators.authguard import login_failed, login_refused, login_retry_after, login_succeeded


def lockout_message(retry_after: int) -> str:
    minutes = max(1, -(-retry_after // 60))
    return (f"Too many failed logins from this address. "
            f"Try again in {minutes} minute{'s' if minutes != 1 else ''}.")


class OperatorLoginForm(AdminAuthenticationForm):
    via = "ui"  # which login page, for the audit event's target (login:ui / login:admin)
    retry_after: int | None = None

    def clean(self):
        username = str(self.data.get("username") or "")[:150]
        where = request_source(self.request) if self.request is not None else RequestSource(source="", peer="")
        retry_after = login_retry_after(username=username, where=where)
        if retry_after is not None:
            self.retry_after = retry_after
            login_refused(username=username, where=where, via=self.via)
            raise ValidationError(lockout_message(retry_after), code="locked")
        try:
            cleaned = super().clean()
        except ValidationError as exc:
            reason = "not an active staff account" if self.user_cache is not None else "wrong username or password"
            login_failed(username=username, where=where, via=self.via, reason=reason)
            raise exc from None
        if self.user_cache is not None:
            login_succeeded(username=self.user_cache.get_username(), where=where, via=self.via)
        return cleaned


class AdminLoginForm(OperatorLoginForm):
    via = "admin"
