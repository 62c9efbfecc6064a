"""Operator UI: operator tokens (``/ui/tokens/``) for the admin API.

Everyone sees the list (prefix, user, role, created, expiry, last used, state); only admins get the
controls (``access.operator_view`` refuses and audits anyone else's POST). The calls are the same
services as ``manage.py create_operator_token`` / ``revoke_operator_token`` (audited
``operator_token.create`` / ``.revoke`` with the operator's name, ``session`` and source).

The raw token exists only in the POST response that created it (``token_created.html``,
``Cache-Control: no-store``): it is never stored, never put in the session or a message, and no GET
shows it. The create form carries a single-use nonce kept in the session, so re-sending the POST
(a reload of that page) mints no second token and shows nothing; the operator is sent back to the
list. Revoking is two steps: a confirmation panel (GET), then the POST it carries.
"""

from __future__ import annotations

import secrets

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_http_methods

from controlplane.common.errors import NotFound
from controlplane.operators.models import OperatorToken
from controlplane.operators.selectors import operator_token_list
from controlplane.operators.services import operator_token_create, operator_token_revoke
from controlplane.ui import present
from controlplane.ui.access import operator_view
from controlplane.ui.forms import ConfirmForm, OperatorTokenForm
from controlplane.ui.model_views import submit
from controlplane.ui.views import _page

NONCES = "ui_token_nonces"  # session key: the create forms handed out and not used yet
NONCES_KEPT = 20


def _new_nonce(request: HttpRequest) -> str:
    nonce = secrets.token_urlsafe(18)
    request.session[NONCES] = [*request.session.get(NONCES, [])[-(NONCES_KEPT - 1):], nonce]
    return nonce


def _use_nonce(request: HttpRequest, nonce: str) -> bool:
    """Whether ``nonce`` was handed out to this session and not used yet (and use it up)."""
    kept = request.session.get(NONCES, [])
    if not nonce or nonce not in kept:
        return False
    request.session[NONCES] = [n for n in kept if n != nonce]
    return True


def _token(token_id: int) -> OperatorToken:
    token = next((t for t in operator_token_list() if t.pk == token_id), None)
    if token is None:
        raise NotFound(f"operator token {token_id} not found", code="operator_token_not_found")
    return token


def _tokens_page(request: HttpRequest, status: int = 200, form: OperatorTokenForm | None = None,
                 confirm: OperatorToken | None = None) -> HttpResponse:
    rows = [present.operator_token_row(t) for t in reversed(operator_token_list())]
    admin = request.operator.is_admin
    if admin and form is None:
        form = OperatorTokenForm(initial={"nonce": _new_nonce(request)})
    elif admin and form.is_bound:  # re-rendered after an error: a fresh nonce for the next try
        data = form.data.copy()
        data["nonce"] = _new_nonce(request)
        form.data = data
    return _page(request, "ui/tokens.html", "tokens", status, tokens=rows, form=form if admin else None,
                 confirm=present.operator_token_row(confirm) if admin and confirm else None)


@operator_view
@require_http_methods(["GET", "POST"])
def tokens(request: HttpRequest) -> HttpResponse:
    """GET: the list (and, for admins, the create form); POST (admin): create a token and show it
    this once."""
    if request.method != "POST":
        return _tokens_page(request)
    form = OperatorTokenForm(request.POST)
    if not _use_nonce(request, request.POST.get("nonce", "")):
        messages.error(request, "This form was already sent (or is too old): no token was created, and a "
                                "token is never shown again. Create a new one if you need it.")
        return redirect("ui:tokens")
    created, status = submit(request, form, lambda d: operator_token_create(
        actor=request.operator.actor, username=d["username"], role=d["role"], expires_days=d["expires_days"]))
    if created is None:
        return _tokens_page(request, status, form=form)
    token, raw = created
    response = _page(request, "ui/token_created.html", "tokens", token=present.operator_token_row(token), raw=raw)
    response["Cache-Control"] = "no-store"
    return response


@operator_view
@require_http_methods(["GET", "POST"])
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    """GET: the list with a confirmation panel for this token (admins); POST (admin, from that
    panel, ``confirm=yes``): revoke it now."""
    token = _token(token_id)
    if request.method != "POST":
        if token.revoked_at is not None:
            messages.info(request, f"Token {token.prefix}… is already revoked.")
            return redirect("ui:tokens")
        return _tokens_page(request, confirm=token)
    form = ConfirmForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Token {token.prefix}… was not revoked: {form.errors['confirm'][0]}.")
        return _tokens_page(request, 422, confirm=token)
    revoked = operator_token_revoke(actor=request.operator.actor, token=token)
    messages.success(request, f"Revoked token {revoked.prefix}… of {revoked.username}: it stops working now.")
    return redirect("ui:tokens")
