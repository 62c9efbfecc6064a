from django.apps import AppConfig


class UiConfig(AppConfig):
    name = "controlplane.ui"
    label = "ui"
    verbose_name = "Operator UI"
