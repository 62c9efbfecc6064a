from django.apps import AppConfig


class OperatorsConfig(AppConfig):
    name = "controlplane.operators"
    label = "operators"
