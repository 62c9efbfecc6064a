"""Canonical encoding and keyed hash of one audit record (docs/design.md section 4).

``hash = HMAC-SHA256(key, canonical_json(fields))`` (hex) where ``fields`` are every column except
``hash`` itself (``prev_hash`` included; ``peer`` and ``forwarded_for`` only when not empty, so events
written before those columns existed verify unchanged), ``time`` as ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` (UTC) and
``old``/``new`` as their JSON values; canonical JSON = sorted keys, no whitespace, UTF-8. An external
verifier holding the key can recompute the chain from an export with nothing but this description.

The key never lives in the database, so someone who can rewrite rows cannot re-hash them: it is
``settings.STRATA_AUDIT_KEY`` (environment ``STRATA_AUDIT_KEY``) or the file
``settings.STRATA_AUDIT_KEY_FILE``: the one ``STRATA_AUDIT_KEY_FILE`` names (a mounted secret: read
as it is, never created or replaced, so a missing mount is an error instead of a new key that no
earlier record verifies under), else ``$STRATA_HOME/audit.key`` (created 0600 on first use). Every
process appending to one database (web, Celery, CLI) must see the same key; back the file up with
the database, since a lost key makes the existing chain unverifiable.

Earlier versions hashed with plain SHA-256 (no key). A log written by them does not verify under
this scheme (``first_bad`` = 1); there is no in-place conversion, since re-hashing would itself be
the forgery the chain exists to detect. Such a log stays checkable with ``sha256`` in place of the
HMAC; start a fresh database for the keyed chain. Test databases are always created fresh.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.conf import settings

from controlplane.env import secret_key_from_file

HASHED_FIELDS = (
    "seq", "time", "actor", "auth_method", "source", "action", "target", "tenant",
    "old", "new", "reason", "result", "prev_hash",
)

OPTIONAL_FIELDS = ("peer", "forwarded_for")  # hashed when not empty

# The shortest key a supplied file may hold (text): 32 characters, e.g. `openssl rand -hex 32` gives 64.
MIN_SUPPLIED_KEY_CHARS = 32

_key_cache: dict[tuple[str | None, str, bool], bytes] = {}


class AuditKeyError(RuntimeError):
    """The supplied audit key file cannot be used; the message says how to fix it."""


def read_supplied_key(path: Path) -> str:
    """The key text in ``path``, a file the operator supplied (``STRATA_AUDIT_KEY_FILE``). Never creates
    it: missing, not a regular file, readable by group or others, or shorter than
    :data:`MIN_SUPPLIED_KEY_CHARS` (surrounding whitespace stripped) is an :class:`AuditKeyError`."""
    try:
        info = path.stat()  # follows symlinks: secret-store mounts link to the real file
    except FileNotFoundError:
        raise AuditKeyError(f"audit key file {path} does not exist (STRATA_AUDIT_KEY_FILE); it is never "
                            "created: mount the key every process of this database uses") from None
    if not stat.S_ISREG(info.st_mode):
        raise AuditKeyError(f"audit key file {path} is not a regular file")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise AuditKeyError(f"audit key file {path} has mode {mode:04o}: group/others may access it; "
                            f"run 'chmod 600 {path}' (owner only) and start again")
    text = path.read_text().strip()
    if len(text) < MIN_SUPPLIED_KEY_CHARS:
        raise AuditKeyError(f"audit key file {path} holds {len(text)} characters; at least "
                            f"{MIN_SUPPLIED_KEY_CHARS} are needed (e.g. openssl rand -hex 32)")
    return text


def audit_key() -> bytes:
    """The chain's HMAC key: ``STRATA_AUDIT_KEY``, else the key file: a supplied one
    (``settings.STRATA_AUDIT_KEY_GENERATE`` false: :func:`read_supplied_key`) or the default one,
    generated on first use. Kept per process once read."""
    configured, path = settings.STRATA_AUDIT_KEY, str(settings.STRATA_AUDIT_KEY_FILE)
    generate = getattr(settings, "STRATA_AUDIT_KEY_GENERATE", True)
    cache_key = (configured, path, generate)
    if cache_key not in _key_cache:
        if configured:
            raw = configured
        elif generate:
            raw = secret_key_from_file(Path(path))
        else:
            raw = read_supplied_key(Path(path))
        _key_cache[cache_key] = raw.encode("utf-8")
    return _key_cache[cache_key]


def canonical_json(value: Any) -> str:
    """Sorted-key, compact JSON text. Non-JSON values (datetimes, UUIDs) become strings."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def canonical_encoding(event: Any) -> bytes:
    """The bytes that are hashed for ``event`` (an AuditEvent or an object with the same attrs)."""
    fields = {name: getattr(event, name) for name in HASHED_FIELDS}
    fields.update({name: value for name in OPTIONAL_FIELDS if (value := getattr(event, name, None))})
    fields["time"] = format_time(fields["time"])
    for name in ("old", "new"):
        fields[name] = None if fields[name] is None else json.loads(fields[name])
    return canonical_json(fields).encode("utf-8")


def event_hash(event: Any, *, key: bytes | None = None) -> str:
    """HMAC-SHA256 hex of ``event``'s canonical encoding under ``key`` (default :func:`audit_key`)."""
    return hmac.new(key if key is not None else audit_key(), canonical_encoding(event), hashlib.sha256).hexdigest()
