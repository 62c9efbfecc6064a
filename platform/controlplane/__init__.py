"""Strata control plane: the Django project (tenants, keys, grants, models, audit, admin API).

``platform/`` is a source root, never a package: this package is importable because
``pyproject.toml`` maps ``controlplane`` to ``platform/controlplane`` and because ``manage.py`` and
pytest put ``platform/`` on ``sys.path``.
"""

# Load the Celery app whenever Django loads, so ``task.delay()`` in the web process uses Strata's
# broker configuration (Celery's Django guide); otherwise it would use Celery's default app.
from controlplane.celery_app import app as celery_app  # noqa: E402

__all__ = ["celery_app"]
