"""Runtime: the control plane's gateway to the Ray cache workers (no models; no business rules)."""

from controlplane.runtime.gateway import workers_ready

__all__ = ["workers_ready"]
