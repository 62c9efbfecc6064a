"""WSGI entry (for WSGI servers and tools; production serves ASGI through uvicorn)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")

application = get_wsgi_application()
