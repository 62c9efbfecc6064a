"""The web process enqueues jobs on Strata's broker, not on Celery's default app."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import django
django.setup()
from controlplane.jobs import services
print(services.celery_app.main, services.celery_app.conf.broker_url)
from controlplane.jobs.tasks import run_job
print(run_job.app.main, run_job.app.conf.broker_url, run_job.name == services.RUN_JOB)
"""


def test_fresh_django_process_sends_jobs_to_the_configured_broker(tmp_path):
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.local", "STRATA_HOME": str(tmp_path),
           "CELERY_BROKER_URL": "redis://127.0.0.1:6379/9"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    # the app the services send jobs with (by name) is the one the task is registered on
    assert out == ["strata", "redis://127.0.0.1:6379/9", "strata", "redis://127.0.0.1:6379/9", "True"]
