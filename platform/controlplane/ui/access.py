"""Who is using the operator UI, and may they do this?

The same rules as a session on the admin API (``adminapi.auth``): a logged-in, active staff user is
an operator; a superuser is an *admin* (may change things), any other staff user a *viewer* (may
only read). A viewer's write attempt is audited (``auth.denied``) and answered 403. CSRF is Django's
middleware's job. Anonymous visitors are sent to the UI's login page (``/ui/login/``, whatever
``settings.LOGIN_URL`` says).

:func:`operator_view` wraps every UI view: it attaches ``request.operator`` and turns any
``ApplicationError`` that escapes the view into a friendly error page with the error's status.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse

from controlplane.adminapi.auth import SAFE_METHODS
from controlplane.audit.services import audit_record
from controlplane.common.actor import Actor
from controlplane.common.errors import ApplicationError
from controlplane.common.sources import request_source
from controlplane.operators.models import OperatorToken

ADMIN = OperatorToken.Role.ADMIN
VIEWER = OperatorToken.Role.VIEWER


@dataclass(frozen=True)
class Operator:
    actor: Actor
    role: str  # "admin" | "viewer"

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


def operator_of(request: HttpRequest) -> Operator | None:
    """The operator behind ``request``'s session, or ``None`` (anonymous, inactive or not staff)."""
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated or not user.is_active or not user.is_staff:
        return None
    role = ADMIN if user.is_superuser else VIEWER
    return Operator(Actor.at(user.get_username(), "session", request_source(request)), role)


def error_page(request: HttpRequest, status: int, message: str) -> HttpResponse:
    """The UI's error page (never a stack trace)."""
    context = {"status": status, "message": message, "operator": getattr(request, "operator", None)}
    return render(request, "ui/error.html", context, status=status)


def operator_view(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """Login required (staff); unsafe methods need the admin role; ApplicationError -> error page."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path(), login_url=reverse("ui:login"))
        operator = operator_of(request)
        if operator is None:
            return error_page(request, 403, "This account is not an operator (staff) account.")
        request.operator = operator
        if request.method not in SAFE_METHODS and not operator.is_admin:
            audit_record(actor=operator.actor, action="auth.denied", target=f"{request.method} {request.path}",
                         reason=f"role {operator.role} may only read", result="denied")
            return error_page(request, 403, f"Your role ({operator.role}) may only read; ask an admin.")
        try:
            return view(request, *args, **kwargs)
        except ApplicationError as exc:
            return error_page(request, exc.status, exc.message)

    return wrapper
