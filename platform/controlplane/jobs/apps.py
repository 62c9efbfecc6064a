from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "controlplane.jobs"
    label = "jobs"
    verbose_name = "Flush and rollout jobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from controlplane.jobs import deletes, signals  # noqa: F401  (delete jobs' executors; resume stale jobs)
