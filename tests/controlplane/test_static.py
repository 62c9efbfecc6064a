"""Static assets (operator UI, Django admin) are served by the app itself in production settings."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import django
django.setup()
from django.test import Client
c = Client(HTTP_HOST="strata.example.com")
for path in ("/static/ui/poll.js", "/static/admin/css/base.css"):
    r = c.get(path, secure=True)
    print(path, r.status_code)
"""


def test_production_settings_serve_ui_and_admin_static_files(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.production", "STRATA_HOME": str(tmp_path),
           "STRATA_SECRET_KEY": "x" * 60, "STRATA_ALLOWED_HOSTS": "strata.example.com"}
    env.pop("DATABASE_URL", None)
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    assert "/static/ui/poll.js 200" in out and "/static/admin/css/base.css 200" in out
