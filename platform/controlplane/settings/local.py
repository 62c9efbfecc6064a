"""Local settings: the default (``make run``, ``manage.py``). Embedded SQLite and broker unless the
environment names real servers. ``STRATA_DEBUG=1`` turns on Django's debug pages (not for /api/ or
/v1/, which always answer JSON errors)."""

from .base import *  # noqa: F403
from .base import ENV, secret_key

SECRET_KEY = secret_key(ENV)
DEBUG = ENV.debug
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "[::1]", *ENV.allowed_hosts]
STRATA_SERVE_STATIC = True
