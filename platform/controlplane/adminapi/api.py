"""The admin NinjaAPI (mounted at /api/admin/, OpenAPI document at /api/admin/openapi.json).

Routers are thin: parse, call one service/selector, shape output. Each app's ``router`` (a
``ninja.Router`` with full relative paths such as ``"flush-jobs"``, ``"models/{name}/rollout"``,
``"stats"``) is listed in :func:`build_api`, mounted at the API root, and inherits operator auth
(admin for writes, viewer for reads) and the JSON error shape.

The OpenAPI document (``/api/admin/openapi.json``) and its docs page (``/api/admin/docs``, Swagger UI
served from django-ninja's own static files, no CDN) are for operators only, like the API they
describe: an operator token or a staff session. Anonymous callers get 401 JSON; a browser opening the
docs page without credentials is sent to the operator UI's login page.
"""

from __future__ import annotations

from collections.abc import Callable

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse
from django.urls import NoReverseMatch, reverse
from ninja import NinjaAPI

from controlplane.adminapi import adapters, audit, datakeys, grants, keys, models, sharegroups, tenants
from controlplane.adminapi.auth import OperatorAuth
from controlplane.common.errors import ApplicationError, error_response, install_ninja_handlers

OPENAPI_URL = "/openapi.json"
DOCS_URL = "/docs"


def operators_only(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """ninja ``docs_decorator``: the OpenAPI document and the docs page need the credentials the API
    itself takes (:class:`OperatorAuth`: bearer token or staff session; viewers may read them)."""

    def guarded(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        try:
            principal = OperatorAuth()(request)
        except ApplicationError as exc:
            return exc.response()
        if principal is None:
            if request.path.endswith(DOCS_URL) and "Authorization" not in request.headers:
                try:
                    return redirect_to_login(request.get_full_path(), login_url=reverse("ui:login"))
                except NoReverseMatch:  # no operator UI installed: a plain 401 below
                    pass
            return error_response(401, "missing or invalid credentials", headers={"WWW-Authenticate": "Bearer"})
        request.auth = principal
        return view(request, *args, **kwargs)

    return guarded


def build_api() -> NinjaAPI:
    api = NinjaAPI(
        title="Strata admin API",
        version="1",
        # Markdown (the docs page renders it): the header sits in a code span, or the renderer drops
        # "<operator token>" as an unknown HTML tag and shows "Authorization: Bearer ,".
        description="Operators manage tenants, keys, grants, models, share groups and audit. "
        "Authenticate with the header `Authorization: Bearer <operator token>` "
        "or with a staff session (with its CSRF token).",
        urls_namespace="adminapi",
        openapi_url=OPENAPI_URL,
        docs_url=DOCS_URL,  # Swagger UI from ninja's static files ("ninja" is an installed app)
        docs_decorator=operators_only,
        auth=OperatorAuth(),
    )
    install_ninja_handlers(api)
    from controlplane.caches import admin_api as caches_api
    from controlplane.jobs import api as jobs_api
    from controlplane.ledger import api as ledger_api
    from controlplane.runtime import api as runtime_api

    for module in (tenants, datakeys, keys, grants, models, adapters, sharegroups, audit, jobs_api, runtime_api,
                   ledger_api, caches_api):
        api.add_router("", module.router)
    return api


api = build_api()
