"""ASGI entry (``uvicorn controlplane.asgi:application``, with ``platform/`` importable: editable
install or ``--app-dir platform``)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")

application = get_asgi_application()
