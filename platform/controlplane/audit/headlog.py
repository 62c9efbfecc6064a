"""The chain head kept outside the database: an append-only file under ``$STRATA_HOME``.

Every committed append writes one line (after the transaction commits, so a rollback never advances
it) to ``settings.STRATA_AUDIT_HEAD_LOG`` (default ``$STRATA_HOME/audit-head.log``, mode 0600)::

    {"seq": 42, "hash": "<hex>", "time": "2026-...Z", "kind": "append"}

``kind`` is ``append``, ``init`` (migration 0003: the head when the file started being kept) or
``reset`` (the test-only flush emptied the log). ``audit_verify`` compares the database against the
highest seq among the last lines (since the latest ``init``/``reset``): someone who deletes the tail
and rewinds the head in the database cannot rewind this file from there. The file may lag the
database by the appends whose process died between commit and write; it is never ahead unless rows
were removed. Rotate it, if ever, by keeping its last line. ``/metrics`` shows its seq too, so a
Prometheus server holds a third, remote copy of the head's progress.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import connections
from django.utils import timezone

from controlplane.audit.chain import format_time

logger = logging.getLogger("controlplane.audit")

TAIL_BYTES = 64 * 1024
BOUNDARY_KINDS = frozenset({"init", "reset"})


@dataclass(frozen=True)
class HeadLine:
    seq: int
    hash: str
    kind: str


def _db_tag(using: str) -> str:
    settings_dict = connections[using].settings_dict
    ident = f"{connections[using].vendor}:{settings_dict.get('HOST') or ''}:{settings_dict['NAME']}"
    return hashlib.sha256(ident.encode("utf-8")).hexdigest()[:16]


def head_log_path(*, using: str = "default") -> Path:
    """The file for database ``using`` (``{db}`` in the setting becomes a tag of its name)."""
    configured = str(settings.STRATA_AUDIT_HEAD_LOG)
    if "{db}" in configured:
        configured = configured.replace("{db}", _db_tag(using))
    return Path(configured)


def head_log_append(*, seq: int, hash: str, kind: str = "append", using: str = "default") -> None:
    """Append one line; a single ``write`` on an ``O_APPEND`` descriptor, so concurrent writers
    (web, Celery, CLI processes) never interleave within a line."""
    path = head_log_path(using=using)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"seq": seq, "hash": hash, "time": format_time(timezone.now()), "kind": kind},
                      separators=(",", ":")) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def head_log_append_quietly(*, seq: int, hash: str, using: str = "default") -> None:
    """``head_log_append`` for an ``on_commit`` hook: the commit has happened, so a failure to write
    is logged (verify then finds the file behind, which it tolerates) rather than raised."""
    try:
        head_log_append(seq=seq, hash=hash, using=using)
    except OSError:
        logger.exception("could not append audit head #%s to %s", seq, head_log_path(using=using))


def _parse(raw: bytes) -> HeadLine | None:
    try:
        item = json.loads(raw)
        return HeadLine(int(item["seq"]), str(item["hash"]), str(item.get("kind", "append")))
    except (ValueError, KeyError, TypeError):
        return None  # a torn first line of the tail window, or junk


def head_log_read(*, using: str = "default") -> HeadLine | None:
    """The highest head recorded since the file's latest ``init``/``reset`` line (within its last
    :data:`TAIL_BYTES`), or ``None`` when there is no file or no line."""
    path = head_log_path(using=using)
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - TAIL_BYTES))
            tail = fh.read()
    except FileNotFoundError:
        return None
    lines = [line for line in (_parse(raw) for raw in tail.splitlines() if raw.strip()) if line]
    starts = [i for i, line in enumerate(lines) if line.kind in BOUNDARY_KINDS]
    current = lines[starts[-1]:] if starts else lines
    return max(current, key=lambda line: line.seq, default=None)
