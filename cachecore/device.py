"""Run-time device choice: ``STRATA_DEVICE`` (read by ``strata_env.device``) or the caller's preference.

Code never hard-wires a device: it asks :func:`pick_device` and passes the answer along.
"""

from __future__ import annotations

import torch

import strata_env


def pick_device(preferred: str | None = None) -> torch.device:
    """Return the torch device to use.

    Order: the ``STRATA_DEVICE`` environment variable (if set and not ``"auto"``), then
    ``preferred`` (if given and not ``"auto"``), then CUDA when available, else CPU.
    An explicit CUDA request on a machine without CUDA raises ``ValueError`` rather than
    silently falling back (the operator asked for something this machine cannot do);
    an unparsable device string also raises ``ValueError``.
    """
    choice = strata_env.device() or preferred
    if choice and choice.lower() != "auto":
        try:
            device = torch.device(choice)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"invalid device {choice!r}: {exc}") from exc
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {choice!r} requested but CUDA is not available")
        return device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
