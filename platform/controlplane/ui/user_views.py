"""Operator UI: console logins (``/ui/users/``). Everyone sees the list (user, role, state, last
login); admins create logins with a role and disable, enable or change them (``operators.accounts``:
``console_user_create`` / ``console_user_set``, audited with the admin's name). A viewer is a staff
user, an admin a superuser too: the same roles as operator tokens. The last active admin can be
neither disabled nor demoted."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_http_methods, require_POST

from controlplane.common.errors import NotFound
from controlplane.operators.accounts import ROLES, console_user_create, console_user_set, role_of
from controlplane.ui.access import operator_view
from controlplane.ui.model_views import submit
from controlplane.ui.views import _page

USER_ERRORS = {"invalid_user": "password", "user_exists": "username", "invalid_role": "role"}


class ConsoleUserForm(forms.Form):
    username = forms.CharField(max_length=150, widget=forms.TextInput(attrs={"autocomplete": "off", "size": 18}))
    password = forms.CharField(widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
                               help_text="Django's password rules apply (length, not common, not all digits)")
    role = forms.ChoiceField(choices=[(r, r) for r in ROLES], initial="viewer",
                             help_text="viewer: read only; admin: may change everything")


def _rows() -> list[dict]:
    users = get_user_model().objects.filter(is_staff=True).order_by("username")
    return [{"id": u.pk, "username": u.get_username(), "role": role_of(u), "active": u.is_active,
             "last_login": u.last_login, "joined": u.date_joined} for u in users]


def _users_page(request: HttpRequest, status: int = 200, form: ConsoleUserForm | None = None) -> HttpResponse:
    admin = request.operator.is_admin
    return _page(request, "ui/users.html", "users", status, users=_rows(),
                 form=(form or ConsoleUserForm()) if admin else None, me=request.operator.actor.name)


@operator_view
@require_http_methods(["GET", "POST"])
def users(request: HttpRequest) -> HttpResponse:
    if request.method != "POST":
        return _users_page(request)
    form = ConsoleUserForm(request.POST)
    user, status = submit(request, form, lambda d: console_user_create(
        actor=request.operator.actor, username=d["username"], password=d["password"], role=d["role"]), USER_ERRORS)
    if user is None:
        return _users_page(request, status, form=form)
    messages.success(request, f"Created {role_of(user)} login {user.get_username()}.")
    return redirect("ui:users")


@operator_view
@require_POST
def user_change(request: HttpRequest, user_id: int) -> HttpResponse:
    """``action``: ``disable``, ``enable``, ``make-admin`` or ``make-viewer``."""
    user = get_user_model().objects.filter(pk=user_id, is_staff=True).first()
    if user is None:
        raise NotFound(f"console user {user_id} not found", code="user_not_found")
    action = request.POST.get("action", "")
    change = {"disable": {"active": False}, "enable": {"active": True}, "make-admin": {"role": "admin"},
              "make-viewer": {"role": "viewer"}}.get(action)
    if change is None:
        messages.error(request, f"Unknown action {action!r}.")
        return _users_page(request, 422)
    console_user_set(actor=request.operator.actor, user=user, reason=f"console: {action}", **change)
    messages.success(request, f"{user.get_username()}: {action.replace('-', ' ')} done.")
    return redirect("ui:users")
