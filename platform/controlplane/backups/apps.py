from django.apps import AppConfig


class BackupsConfig(AppConfig):
    name = "controlplane.backups"
    label = "backups"
    verbose_name = "Backups and restores"
