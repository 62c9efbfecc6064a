"""The Celery application. Workers start with ``celery -A controlplane.celery_app worker``.

Configuration comes from Django settings (``CELERY_*``): the broker is ``CELERY_BROKER_URL`` when set
(Redis or RabbitMQ in production and CI), otherwise kombu's SQLAlchemy transport on a SQLite file
under STRATA_HOME so ``make run`` needs no broker server. Tasks live in ``controlplane.jobs.tasks``.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.local")

app = Celery("strata")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Ray's driver needs real file descriptors for stdout/stderr (faulthandler), so Celery must not swap
# them for logging proxies.
app.conf.worker_redirect_stdouts = False
app.autodiscover_tasks(["controlplane.jobs"])
