"""The serving app: after every ``migrate`` the access-generation triggers are put back (SQLite drops a
table's triggers when a migration rebuilds the table)."""

from django.apps import AppConfig
from django.db.models.signals import post_migrate


def _reinstall_triggers(using: str = "default", **kwargs) -> None:
    from django.db import connections

    from controlplane.serving import access_generation

    access_generation.install(connections[using])


class ServingConfig(AppConfig):
    name = "controlplane.serving"
    label = "serving"

    def ready(self) -> None:
        post_migrate.connect(_reinstall_triggers, sender=self, dispatch_uid="serving-access-triggers")
