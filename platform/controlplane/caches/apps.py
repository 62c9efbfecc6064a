from django.apps import AppConfig


class CachesConfig(AppConfig):
    name = "controlplane.caches"
    label = "caches"
    verbose_name = "Named caches"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from controlplane.timeseries.apps import sampler_enabled

        if sampler_enabled():  # the process that runs the periodic duties (caches.sweeper)
            from controlplane.caches import sweeper

            sweeper.start()
