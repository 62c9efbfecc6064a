from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "controlplane.audit"
    label = "audit"
    verbose_name = "Audit log"

    def ready(self) -> None:
        from controlplane.audit import checks  # noqa: F401  (a Celery worker verifies the chain hourly)
