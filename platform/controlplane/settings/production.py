"""Production settings: ``manage.py check --deploy`` is clean when the deployment sets
``STRATA_SECRET_KEY`` (or provides the key file under ``STRATA_HOME``) and ``STRATA_ALLOWED_HOSTS``.

TLS is assumed: cookies are secure, HSTS is on and plain HTTP redirects to HTTPS (except the health
probes). Behind a TLS-terminating proxy set ``STRATA_BEHIND_TLS_PROXY=1`` so that
``X-Forwarded-Proto`` is trusted.
"""

from django.core.exceptions import ImproperlyConfigured

from .base import *  # noqa: F403
from .base import ENV, secret_key

if not ENV.allowed_hosts:
    raise ImproperlyConfigured("production settings need STRATA_ALLOWED_HOSTS (comma-separated host names)")

SECRET_KEY = secret_key(ENV)
DEBUG = False
ALLOWED_HOSTS = list(ENV.allowed_hosts)

SECURE_SSL_REDIRECT = ENV.secure_ssl_redirect
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
if ENV.behind_tls_proxy:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_HSTS_SECONDS = ENV.hsts_seconds
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
SESSION_COOKIE_SECURE = True
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_SECURE = True
X_FRAME_OPTIONS = "DENY"
