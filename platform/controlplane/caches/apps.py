from django.apps import AppConfig


class CachesConfig(AppConfig):
    name = "controlplane.caches"
    label = "caches"
    verbose_name = "Named caches"
    default_auto_field = "django.db.models.BigAutoField"
