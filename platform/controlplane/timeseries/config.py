"""The sampler's interval and retention: ``STRATA_SAMPLE_INTERVAL_SECONDS`` (default 30) and
``STRATA_SAMPLE_RETENTION_SECONDS`` (default 24 h) in Django settings, validated here."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

DEFAULT_INTERVAL_SECONDS = 30
DEFAULT_RETENTION_SECONDS = 24 * 3600


@dataclass(frozen=True)
class SamplerConfig:
    interval_seconds: int = DEFAULT_INTERVAL_SECONDS
    retention_seconds: int = DEFAULT_RETENTION_SECONDS

    def __post_init__(self) -> None:
        if self.interval_seconds < 1:
            raise ValueError(f"sample interval must be at least 1 s, got {self.interval_seconds}")
        if self.retention_seconds < self.interval_seconds:
            raise ValueError(f"sample retention ({self.retention_seconds} s) is shorter than the interval "
                             f"({self.interval_seconds} s)")


def sampler_config() -> SamplerConfig:
    return SamplerConfig(
        interval_seconds=int(getattr(settings, "STRATA_SAMPLE_INTERVAL_SECONDS", DEFAULT_INTERVAL_SECONDS)),
        retention_seconds=int(getattr(settings, "STRATA_SAMPLE_RETENTION_SECONDS", DEFAULT_RETENTION_SECONDS)),
    )
