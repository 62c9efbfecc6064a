"""What a backup archive holds: its member names, its manifest and the migration heads.

The manifest (``manifest.json``, the archive's last member, so that the checksums of everything
before it are known when it is written)::

    {"format": "strata-backup/1", "created": "<UTC ISO time>", "host": "...",
     "versions": {"strata", "django", "python"},
     "database": {"vendor": "postgresql" | "sqlite", "member", "server_version", "tool"},
     "migrations": {"<app>": ["<applied migration with no applied successor>", ...]},
     "audit": {"seq", "hash", "length"},              # the chain head inside the dump
     "keys": {"master" | "audit" | "secret": {"source": "file" | "env" | "absent",
                                               "fingerprint": hex | null, "member": name | null}},
     "head_log": {"member": name | null},
     "l3": {"kind": "file" | "redis" | "none" | ..., "url": "<without credentials>",
            "objects": int, "bytes": int, "note": str | null},
     "files": {"<member>": {"sha256": hex, "size": int}}}

Every member but the manifest is listed in ``files``; a restore refuses an archive with a member
that is not listed, a listed one that is missing, or one whose bytes do not hash to the listed value.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, BinaryIO

FORMAT = "strata-backup/1"
MANIFEST = "manifest.json"
MASTER_KEY = "keys/master.key"
AUDIT_KEY = "keys/audit.key"
SECRET_KEY = "keys/secret_key"
KEY_MEMBERS = {"master": MASTER_KEY, "audit": AUDIT_KEY, "secret": SECRET_KEY}
HEAD_LOG = "audit/audit-head.log"
DATABASE_MEMBERS = {"postgresql": "database/postgresql.dump", "sqlite": "database/db.sqlite3"}
L3_PREFIX = "l3/"
MAX_KEY_BYTES = 4096  # a key file is 32 bytes (raw) to about 70 (text); anything larger is not a key
MAX_MANIFEST_BYTES = 64 * 1024 * 1024  # ~100 bytes per L3 object listed: room for about 600,000

_REQUIRED = ("format", "created", "versions", "database", "migrations", "audit", "keys", "head_log", "l3", "files")


class BackupError(Exception):
    """A backup or restore that cannot go on; the message tells the operator why and what to do."""


def sha256_file(fileobj: BinaryIO, chunk: int = 1 << 20) -> tuple[str, int]:
    """``(hex digest, size)`` of everything ``fileobj`` yields from where it stands."""
    digest, size = hashlib.sha256(), 0
    while block := fileobj.read(chunk):
        digest.update(block)
        size += len(block)
    return digest.hexdigest(), size


def encode(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode("utf-8")


def decode(raw: bytes) -> dict[str, Any]:
    """The manifest in ``raw``, checked for this format and its required fields."""
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise BackupError(f"the archive's {MANIFEST} is not JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise BackupError(f"not a Strata backup of format {FORMAT} (its manifest says {found!r})")
    missing = [name for name in _REQUIRED if name not in manifest]
    if missing:
        raise BackupError(f"the archive's manifest lacks {', '.join(missing)}")
    files = manifest["files"]
    if not isinstance(files, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("size"), int)
            for v in files.values()):
        raise BackupError("the archive's manifest has a malformed file list")
    if manifest["database"].get("vendor") not in DATABASE_MEMBERS:
        raise BackupError(f"the archive holds an unknown database vendor {manifest['database'].get('vendor')!r}")
    return manifest


def is_l3_member(name: str) -> bool:
    return name.startswith(L3_PREFIX) and len(name) > len(L3_PREFIX)


def l3_object_name(member: str) -> str:
    return member[len(L3_PREFIX):]


# ---------------------------------------------------------------------------------------- migrations
def _loader():
    from django.db.migrations.loader import MigrationLoader

    return MigrationLoader(None, ignore_no_migrations=True)  # this code's migration files, no database


def migration_heads(applied: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """Per app, the applied migrations that no applied migration of the same app follows (one per
    app unless the app's history branched). A migration this code does not know is a head too."""
    graph = _loader().graph
    applied = {(str(app), str(name)) for app, name in applied}
    heads: dict[str, list[str]] = {}
    for key in sorted(applied):
        node = graph.node_map.get(key)
        children = {child.key for child in node.children} if node is not None else set()
        if not any(child in applied and child[0] == key[0] for child in children):
            heads.setdefault(key[0], []).append(key[1])
    return heads


def unknown_migrations(heads: dict[str, list[str]]) -> list[str]:
    """The heads this code has no migration file for (a newer release made the backup); a migration
    that a squashed one replaces counts as known."""
    loader = _loader()
    known = set(loader.graph.nodes)
    known.update(key for migration in loader.replacements.values() for key in migration.replaces)
    return [f"{app}.{name}" for app, names in sorted(heads.items()) for name in names if (app, name) not in known]
