"""Login views' glue: the lockout page (429) and the Django admin's login wrapped with it.

``admin_login`` is routed at ``/admin/login/`` ahead of the admin site (``controlplane.urls``): it
runs the admin's own login view, whose form is ``forms.AdminLoginForm`` (set in ``admin.py``), and
turns a locked attempt into the lockout page.
"""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.decorators import login_not_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache

from controlplane.operators.forms import lockout_message


def lockout_response(request: HttpRequest, *, retry_after: int, login_url: str) -> HttpResponse:
    """429 with ``Retry-After`` and a page saying when to come back (no stack, no account details)."""
    context = {"message": lockout_message(retry_after), "login_url": login_url, "retry_after": retry_after}
    response = render(request, "ui/lockout.html", context, status=429)
    response["Retry-After"] = str(retry_after)
    response["Cache-Control"] = "no-store"
    return response


def locked_form_retry_after(response: HttpResponse) -> int | None:
    """``retry_after`` of the login form a (not yet rendered) login response carries, if locked."""
    form = (getattr(response, "context_data", None) or {}).get("form")
    return getattr(form, "retry_after", None)


@login_not_required
@never_cache
def admin_login(request: HttpRequest) -> HttpResponse:
    response = admin.site.login(request)
    retry_after = locked_form_retry_after(response)
    if retry_after is not None:
        return lockout_response(request, retry_after=retry_after, login_url=request.get_full_path())
    return response
