"""Reads of a revision's digest state, for the admin API, the console and the gateway (``hold``)."""

from __future__ import annotations

from controlplane.hashing.models import WeightHash


def digest_state(revision) -> dict:
    """``{"state": "ready"}`` for a revision with its digest; else ``hashing`` (``done_bytes``,
    ``total_bytes``), ``failed`` (``error``) or ``pending`` (no hashing recorded), each with a
    ``message`` for operators. One query, only for a revision whose digest is not known."""
    if revision.digest:
        return {"state": "ready"}
    row = WeightHash.objects.filter(pk=revision.pk).first()
    if row is None:
        return {"state": "pending", "message": "weights digest pending"}
    if row.state == WeightHash.State.FAILED:
        return {"state": "failed", "error": row.error, "message": f"hashing weights failed: {row.error}"}
    percent = int(100 * row.done_bytes / row.total_bytes) if row.total_bytes else 0
    return {"state": "hashing", "done_bytes": row.done_bytes, "total_bytes": row.total_bytes,
            "message": f"hashing weights ({row.done_bytes:,} of {row.total_bytes:,} bytes, {percent}%)"}


def hold(revision) -> tuple[str, str] | None:
    """Why no replica may serve ``revision`` yet, as ``(error code, message)`` (``model_starting``
    while its digest is computed, ``model_failed`` when hashing failed), or None: its digest is known.
    Nothing forms a cache namespace from a revision held here."""
    if revision.digest:
        return None
    state = digest_state(revision)
    if state["state"] == "failed":
        return "model_failed", f"revision {revision.label!r} cannot serve: {state['message']}"
    return "model_starting", f"revision {revision.label!r} is starting: {state['message']}; retry shortly"
