"""Canonical encoding and hash of one audit record (DESIGN section 4).

``hash = sha256(canonical_json(fields))`` where ``fields`` are every column except ``hash`` itself
(``prev_hash`` included), ``time`` as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (UTC) and ``old``/``new`` as
their JSON values; canonical JSON = sorted keys, no whitespace, UTF-8. An external verifier can
recompute the chain from an export with nothing but this description.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

HASHED_FIELDS = (
    "seq", "time", "actor", "auth_method", "source", "action", "target", "tenant",
    "old", "new", "reason", "result", "prev_hash",
)


def canonical_json(value: Any) -> str:
    """Sorted-key, compact JSON text. Non-JSON values (datetimes, UUIDs) become strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_hash(event: Any) -> str:
    """SHA-256 hex of ``event``'s canonical encoding (``event``: an AuditEvent or same-named attrs)."""
    fields = {name: getattr(event, name) for name in HASHED_FIELDS}
    fields["time"] = format_time(fields["time"])
    for name in ("old", "new"):
        fields[name] = None if fields[name] is None else json.loads(fields[name])
    return hashlib.sha256(canonical_json(fields).encode("utf-8")).hexdigest()
