from django.apps import AppConfig


class HashingConfig(AppConfig):
    name = "controlplane.hashing"
    default_auto_field = "django.db.models.BigAutoField"
