"""Root-level routes of the runtime app."""

from django.urls import path

from controlplane.runtime import prometheus

urlpatterns = [path("metrics", prometheus.metrics, name="metrics")]
