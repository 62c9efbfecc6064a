from django.apps import AppConfig

import strata_env

SAMPLER_FLAG = strata_env.SAMPLER  # set to 1 by the launcher for its uvicorn process only


def sampler_enabled(environ=None) -> bool:
    """Whether this process runs the sampler thread (``STRATA_SAMPLER=1``). ``make run`` sets it for
    the web process and no other, so management commands, Celery and tests never sample."""
    return strata_env.sampler(environ)


class TimeseriesConfig(AppConfig):
    name = "controlplane.timeseries"
    label = "timeseries"
    verbose_name = "Counter time series"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        if sampler_enabled():
            from controlplane.timeseries import sampler

            sampler.start()
