"""The admin NinjaAPI (mounted at /api/admin/, OpenAPI document at /api/admin/openapi.json).

Routers are thin: parse, call one service/selector, shape output. Other parts of the platform add
theirs without editing this file: a module listed in :data:`OPTIONAL_ROUTERS` that exists must
expose ``router`` (a ``ninja.Router`` with full relative paths such as ``"flush-jobs"``,
``"models/{name}/rollout"``, ``"stats"``); it is mounted at the API root and inherits operator auth
(admin for writes, viewer for reads) and the JSON error shape.
"""

from __future__ import annotations

import importlib

from ninja import NinjaAPI

from controlplane.adminapi import audit, grants, keys, models, sharegroups, tenants
from controlplane.adminapi.auth import OperatorAuth
from controlplane.common.errors import install_ninja_handlers
from controlplane.common.hooks import module_exists

OPTIONAL_ROUTERS = ["controlplane.jobs.api", "controlplane.runtime.api"]


def build_api() -> NinjaAPI:
    api = NinjaAPI(
        title="Strata admin API",
        version="1",
        description="Operators manage tenants, keys, grants, models, share groups and audit. "
        "Authorization: Bearer <operator token>, or a staff session with CSRF.",
        urls_namespace="adminapi",
        openapi_url="/openapi.json",
        docs_url=None,  # the docs page loads assets from a CDN; the JSON document is enough
        auth=OperatorAuth(),
    )
    install_ninja_handlers(api)
    for module in (tenants, keys, grants, models, sharegroups, audit):
        api.add_router("", module.router)
    for name in OPTIONAL_ROUTERS:
        if module_exists(name):
            api.add_router("", importlib.import_module(name).router)
    return api


api = build_api()
