"""Strata control plane: the Django project (tenants, keys, grants, models, audit, admin API).

``platform/`` is a source root, never a package: this package is importable because
``pyproject.toml`` maps ``controlplane`` to ``platform/controlplane`` and because ``manage.py`` and
pytest put ``platform/`` on ``sys.path``.
"""
