"""Each replica's state as every process sees it, for operators (``/readyz``, the admin API's
``GET models/{name}``, the console's model page).

The state comes from the replica board (``workers.replica_board``: what the starting process and the
replica's actor reported, shared through Ray) checked against Ray's directory of named actors (does
the actor exist now?), never from this process's memory and never by calling a replica, so no read
waits on a starting or dead replica:

- ``starting``: ``elapsed_s`` since the start began and, where known, its ``phase``;
- ``ready``: its actor answered (the engine is built);
- ``failed``: its start failed (``error``), or its actor is gone while it should run;
- ``stopping``: being drained and shut down; ``stopped``: not running (a stopped deployment's
  replicas, or a configured one nobody started yet);
- ``unknown``: its actor runs but the board has no record of it (the board was lost).
"""

from __future__ import annotations

import logging

from workers import replica_board
from workers.actor import actor_name

logger = logging.getLogger("controlplane.runtime")

LAUNCH_GRACE_S = 60.0  # a start reported while its actor is not yet registered with Ray


def _exists(ray, name: str) -> bool:
    try:
        ray.get_actor(name, namespace=replica_board.NAMESPACE)
        return True
    except ValueError:
        return False


def _state(index: int, name: str, entry: dict | None, exists: bool, configured: bool) -> dict:
    out = {"replica": index, "name": name, "state": "stopped"}
    state = entry["state"] if entry else None
    age = (entry["now"] - entry["since"]) if entry else 0.0
    if exists:
        out["state"] = state or "unknown"
    elif configured and state == "failed":
        out["state"] = "failed"
    elif configured and state == "starting" and age < LAUNCH_GRACE_S:
        out["state"] = "starting"
    elif configured and state in ("ready", "starting"):
        out.update(state="failed", error="its actor is gone (it died, or was stopped outside Strata)")
    if out["state"] in ("starting", "stopping"):
        out["elapsed_s"] = round(age, 1)
        out["phase"] = entry.get("phase") if entry else None
    if out["state"] == "failed" and "error" not in out:
        out["error"] = (entry or {}).get("error")
    return out


def replica_states(deployment: str, replicas: int) -> list[dict] | None:
    """The states of ``deployment``'s configured replicas (``0..replicas-1``) and of any other replica
    of it the board or Ray still knows (one being stopped), in index order; None when Ray cannot be
    reached. Blocking (Ray's directory, the board): at most a few seconds, never a replica call."""
    from controlplane.runtime import gateway

    try:
        ray = gateway.join()
    except Exception:
        return None
    prefix = actor_name(deployment, 0)[:-1]  # "cache-worker:<deployment>:"
    board = replica_board.snapshot(prefix) or {}
    indices = set(range(replicas))
    for name in board:
        tail = name[len(prefix):]
        if tail.isdigit():
            indices.add(int(tail))
    out = []
    for index in sorted(indices):
        name = actor_name(deployment, index)
        try:
            exists = _exists(ray, name)
        except Exception as exc:  # Ray's directory is away: no state rather than a wrong one
            logger.info("could not look %s up: %r", name, exc)
            return None
        state = _state(index, name, board.get(name), exists, index < replicas)
        if index < replicas or state["state"] != "stopped" or replicas == 0:
            out.append(state)
    return out


def deployment_states() -> dict[str, dict] | None:
    """``{deployment: {"replicas", "status", "states"}}`` for every deployment with an active revision
    (``/readyz``'s operator detail); None when Ray cannot be reached."""
    from controlplane.registry.models import ModelDeployment

    out = {}
    for deployment in ModelDeployment.objects.filter(active_revision__isnull=False).order_by("name"):
        states = replica_states(deployment.name, deployment.replicas)
        if states is None:
            return None
        out[deployment.name] = {"replicas": deployment.replicas,
                                "status": "stopped" if deployment.replicas == 0 else "running",
                                "states": states}
    return out
