from django.apps import AppConfig


class RuntimeConfig(AppConfig):
    name = "controlplane.runtime"
    label = "runtime"
    verbose_name = "Cache worker runtime"
