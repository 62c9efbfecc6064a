import os

from django.apps import AppConfig

from controlplane import env as envmod

SAMPLER_FLAG = "STRATA_SAMPLER"  # set to 1 by the launcher for its uvicorn process only


def sampler_enabled(environ=None) -> bool:
    """Whether this process runs the sampler thread (``STRATA_SAMPLER=1``). ``make run`` sets it for
    the web process and no other, so management commands, Celery and tests never sample."""
    src = os.environ if environ is None else environ
    return src.get(SAMPLER_FLAG, "").strip().lower() in envmod.TRUE


class TimeseriesConfig(AppConfig):
    name = "controlplane.timeseries"
    label = "timeseries"
    verbose_name = "Counter time series"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        if sampler_enabled():
            from controlplane.timeseries import sampler

            sampler.start()
