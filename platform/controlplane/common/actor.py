"""Who performs a change: passed (keyword-only) to every service that writes, recorded in audit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Actor:
    """The principal behind a service call.

    ``name`` is an operator username, ``"cli:<user>"`` or ``"system:<component>"``; ``auth_method``
    is ``"token"``, ``"session"``, ``"cli"`` or ``"system"``; ``source`` is the client address (or
    ``""`` when there is none). Never a secret.
    """

    name: str
    auth_method: str
    source: str = ""

    @classmethod
    def system(cls, component: str) -> Actor:
        """An internal caller (a Celery task, a migration, the rollout job)."""
        return cls(name=f"system:{component}", auth_method="system")

    @classmethod
    def cli(cls, username: str = "") -> Actor:
        """A management command run by a shell user."""
        return cls(name=f"cli:{username}" if username else "cli", auth_method="cli", source="localhost")
