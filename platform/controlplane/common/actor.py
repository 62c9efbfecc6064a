"""Who performs a change: passed (keyword-only) to every service that writes, recorded in audit."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.common.sources import RequestSource


@dataclass(frozen=True)
class Actor:
    """The principal behind a service call.

    ``name`` is an operator username, ``"cli:<user>"`` or ``"system:<component>"``; ``auth_method``
    is ``"token"``, ``"session"``, ``"cli"`` or ``"system"``; ``source`` is the client address (or
    ``""`` when there is none), ``peer`` and ``forwarded_for`` how it was derived
    (``common.sources``: the TCP peer, the ``X-Forwarded-For`` chain as received). Never a secret.
    """

    name: str
    auth_method: str
    source: str = ""
    peer: str = ""
    forwarded_for: str = ""

    @classmethod
    def at(cls, name: str, auth_method: str, where: RequestSource) -> Actor:
        """``name`` authenticated by ``auth_method`` from ``where`` (``sources.request_source``)."""
        return cls(name=name, auth_method=auth_method, source=where.source, peer=where.peer,
                   forwarded_for=where.forwarded_for)

    @classmethod
    def system(cls, component: str) -> Actor:
        """An internal caller (a Celery task, a migration, the rollout job)."""
        return cls(name=f"system:{component}", auth_method="system")

    @classmethod
    def cli(cls, username: str = "") -> Actor:
        """A management command run by a shell user."""
        return cls(name=f"cli:{username}" if username else "cli", auth_method="cli", source="localhost")
