"""Root URLs. Parts owned by other apps are included only when their modules exist:
``controlplane.serving.urls`` at /v1/, and ``controlplane.{jobs,runtime,ui}.urls`` at the root
(for /metrics, operator pages...)."""

from django.conf import settings
from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import include, path, re_path

from controlplane import health
from controlplane.adminapi.api import api as admin_api
from controlplane.operators.views import admin_login

# The Django admin is Strata's records view (read-only models; changes go through the console, which
# validates and audits them): branded so, and linked from the console's Users page.
admin.site.site_header = "Strata records (Django admin)"
admin.site.site_title = "Strata records"
admin.site.index_title = "Read-only records: change things in the operator console (/ui/)"
admin.site.site_url = "/ui/"

urlpatterns = [
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("api/admin/", admin_api.urls),
    # The admin's login, throttled and audited (operators.forms.AdminLoginForm) with a 429 lockout
    # page; it shadows the admin site's own login route, so no other way in skips the throttle.
    path("admin/login/", admin_login, name="admin-login"),
    path("admin/", admin.site.urls),
]

urlpatterns += [
    path("v1/", include("controlplane.serving.urls")),
    path("", include("controlplane.runtime.urls")),
    path("", include("controlplane.ui.urls")),
]

if settings.STRATA_SERVE_STATIC:
    # Single-process local runs have no web server in front; serve /static/ from the finders.
    urlpatterns.append(
        re_path(rf"^{settings.STATIC_URL.lstrip('/')}(?P<path>.*)$", serve_static, {"insecure": True})
    )
