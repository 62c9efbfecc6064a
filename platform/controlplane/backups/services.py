"""The two procedures: :func:`backup_create` and :func:`backup_restore`, each audited.

``backup_create`` reads the keys and copies the audit head log first, then dumps the database (one
consistent state: ``database.dump``), so the head log is never ahead of the dumped chain (the
verifier accepts a log that lags, never one that leads). The L3 objects are copied after the dump;
the manifest closes the archive. The archive appears at its path only once complete (``archive``).
An audit event ``backup.create`` names the archive and its manifest's SHA-256 afterwards (it is not
in the archive it describes).

``backup_restore`` changes nothing until every check has passed: every member's checksum, the
database vendor, migrations this code knows (a backup of a newer release is refused), L3 object
names and where they can go, the keys (``keys.plan``) and, unless ``force``, an empty target (no
table in the database, no audit head log, no L3 object). Then it installs the keys, restores the
database (one transaction), puts the archived head log in place (a head log already there is kept
beside it as ``<name>.before-restore-<time>``), writes the L3 objects, applies this code's newer
migrations, appends ``backup.restore`` to the restored chain and verifies the whole chain: a restore
that returns has a verifying chain, and one that does not raises :class:`BackupError`.
"""

from __future__ import annotations

import importlib.metadata
import os
import secrets
import shutil
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import django
from django.conf import settings
from django.core.management import call_command
from django.db import connection, connections
from django.utils import timezone

from controlplane.audit.headlog import head_log_path
from controlplane.audit.models import GENESIS_HASH, AuditHead
from controlplane.audit.selectors import VerifyResult, audit_verify
from controlplane.audit.services import audit_record
from controlplane.backups import database, keys, l3
from controlplane.backups import manifest as mf
from controlplane.backups.archive import ArchiveReader, ArchiveWriter
from controlplane.backups.manifest import BackupError
from controlplane.common.actor import Actor


@dataclass(frozen=True)
class BackupResult:
    path: Path
    manifest_sha256: str
    size: int  # bytes of the archive
    manifest: dict[str, Any]


@dataclass(frozen=True)
class RestoreResult:
    manifest_sha256: str
    manifest: dict[str, Any]
    keys: dict[str, str]  # key name -> what was done (keys.KeyAction.action)
    l3_objects: int  # objects written into the L3 store
    migrations_applied: int  # this code's migrations newer than the backup's
    verify: VerifyResult  # the restored chain, the restore's own event included
    notes: list[str] = field(default_factory=list)


def _strata_version() -> str:
    try:
        return importlib.metadata.version("strata")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------------------- backup
def backup_create(*, actor: Actor, path: Path, include_l3: bool = True) -> BackupResult:
    """Write a new archive at ``path`` (refused if anything is there) and audit it."""
    infos = {name: keys.current(name) for name in keys.NAMES}
    store = l3.configured()
    out = Path(path).absolute()
    with ArchiveWriter(out) as writer, \
            tempfile.TemporaryDirectory(dir=out.parent, prefix=".strata-backup-") as staging:
        for name, info in infos.items():
            if info.raw is not None:
                writer.add_bytes(mf.KEY_MEMBERS[name], info.raw)
        head_log = head_log_path()
        head_copy = Path(staging) / "audit-head.log"
        try:  # before the dump: the copy can only lag the dumped chain
            shutil.copyfile(head_log, head_copy)
        except FileNotFoundError:
            head_copy = None
        dump_file = Path(staging) / "database"
        dumped = database.dump(dump_file)
        if head_copy is not None:
            writer.add_file(mf.HEAD_LOG, head_copy)
        db_member = mf.DATABASE_MEMBERS[dumped.vendor]
        writer.add_file(db_member, dump_file)
        dump_file.unlink()
        objects = n_bytes = 0
        note = None
        if store.kind == "file" and include_l3:
            for name, data in l3.objects(store):
                writer.add_bytes(mf.L3_PREFIX + name, data)
                objects, n_bytes = objects + 1, n_bytes + len(data)
        elif store.kind == "file":
            note = "left out (--no-l3)"
        elif store.kind != "none":
            note = l3.REDIS_NOTE if store.kind.startswith("redis") else f"a {store.kind} L3 is not copied"
        manifest = {
            "format": mf.FORMAT, "created": timezone.now().isoformat(), "host": socket.gethostname(),
            "versions": {"strata": _strata_version(), "django": django.get_version(), "python": sys.version.split()[0]},
            "database": {"vendor": dumped.vendor, "member": db_member, "server_version": dumped.server_version,
                         "tool": dumped.tool},
            "migrations": mf.migration_heads(dumped.applied),
            "audit": dumped.audit,
            "keys": {name: keys.manifest_entry(info, mf.KEY_MEMBERS[name]) for name, info in infos.items()},
            "head_log": {"member": mf.HEAD_LOG if head_copy is not None else None},
            "l3": {"kind": store.kind, "url": store.url, "objects": objects, "bytes": n_bytes, "note": note},
        }
        digest = writer.finish(manifest)
    manifest["files"] = writer.files
    audit_record(actor=actor, action="backup.create", target=out.name[:255],
                 new={"path": str(out), "manifest_sha256": digest, "audit_seq": dumped.audit["seq"],
                      "database": dumped.vendor, "l3_objects": objects})
    return BackupResult(out, digest, out.stat().st_size, manifest)


# ---------------------------------------------------------------------------------------- restore
def _occupied(store: l3.L3Store | None) -> list[str]:
    """What the target already holds that a restore would replace."""
    found = []
    if tables := database.tables():
        found.append(f"the database has {len(tables)} tables")
    head_log = head_log_path()
    if head_log.exists() and head_log.stat().st_size:
        found.append(f"{head_log} exists")
    if store is not None and l3.holds_objects(store):
        found.append(f"the L3 store {store.root} holds objects")
    return found


def _place_head_log(staged: Path | None) -> list[str]:
    """Put the archived head log where this installation keeps it; a file already there (another
    chain's heads) is moved aside, never deleted."""
    notes = []
    target = head_log_path()
    if target.exists():
        aside = target.with_name(f"{target.name}.before-restore-{timezone.now():%Y%m%dT%H%M%SZ}")
        target.rename(aside)
        notes.append(f"the head log that was here is kept as {aside}")
    if staged is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.restore-{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out, open(staged, "rb") as src:
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    return notes


def _pending_migrations() -> int:
    from django.db.migrations.executor import MigrationExecutor

    executor = MigrationExecutor(connection)
    return len(executor.migration_plan(executor.loader.graph.leaf_nodes()))


def backup_restore(*, actor: Actor, path: Path, force: bool = False, include_l3: bool = True) -> RestoreResult:
    """Restore the archive at ``path`` into this installation (see the module doc for the order)."""
    with ArchiveReader(Path(path)) as archive:
        m = archive.manifest
        kept = archive.verify(keep=lambda name: name in mf.KEY_MEMBERS.values())
        # ---- checks: nothing is written before they all pass
        db_member = m["database"].get("member")
        if db_member != mf.DATABASE_MEMBERS[m["database"]["vendor"]] or db_member not in m["files"]:
            raise BackupError("the archive's manifest names no database member")
        if database.vendor() != m["database"]["vendor"]:
            raise BackupError(f"the archive holds a {m['database']['vendor']} database and this installation uses "
                              f"{database.vendor()}: restore into the same kind of database")
        if unknown := mf.unknown_migrations(m["migrations"]):
            raise BackupError(f"the archive was made by a newer release (this code has no migration {unknown[0]}): "
                              f"restore it with the release that made it (Strata {m['versions'].get('strata')}) "
                              "or a newer one")
        l3_members = [name for name in m["files"] if mf.is_l3_member(name)]
        for name in l3_members:
            l3.check_object_name(mf.l3_object_name(name))
        store = l3.configured()
        restore_l3 = include_l3 and bool(l3_members)
        if restore_l3 and store.kind != "file":
            raise BackupError(f"the archive holds {len(l3_members)} L3 objects and this installation's L3 is "
                              f"{store.url}: objects are restored into a file:// store only. Pass --no-l3 to "
                              "restore without them (L3 is a cache: they are computed again)")
        actions = {name: keys.plan(name, m["keys"].get(name, {}), kept.get(mf.KEY_MEMBERS[name]))
                   for name in keys.NAMES}
        occupied = _occupied(store if restore_l3 else None)
        if occupied and not force:
            raise BackupError(f"the target is not empty ({'; '.join(occupied)}): restore into a fresh database "
                              "and STRATA_HOME, or pass --force to replace what is there")
        # ---- act
        for action in actions.values():
            keys.install(action)
        notes: list[str] = []
        written = 0
        writer = l3.Writer(store) if restore_l3 else None
        wanted = {db_member, mf.HEAD_LOG}
        with tempfile.TemporaryDirectory(dir=settings.STRATA_HOME, prefix=".restore-") as staging:
            dump_file, head_file = Path(staging) / "database", Path(staging) / "audit-head.log"
            restored = False
            for name, opened in archive.members(lambda n: n in wanted or (restore_l3 and mf.is_l3_member(n))):
                if name in wanted:
                    target = dump_file if name == db_member else head_file
                    with opened as fh, open(target, "xb") as out:
                        shutil.copyfileobj(fh, out, 1 << 20)
                    if name == db_member:
                        database.restore(dump_file, dumped_vendor=m["database"]["vendor"], force=force)
                        notes += _place_head_log(head_file if head_file.exists() else None)
                        restored = True
                else:
                    if not restored:  # archive_create writes the database first; refuse anything else
                        raise BackupError("the archive's L3 objects come before its database")
                    with opened as fh:
                        data = fh.read()
                    assert writer is not None
                    writer.put(mf.l3_object_name(name), data)
                    written += 1
            if not restored:
                raise BackupError("the archive's database member was not found")
    connections.close_all()
    head = AuditHead.objects.filter(pk=1).values_list("seq", "hash").first() or (0, GENESIS_HASH)
    if (head[0], head[1]) != (m["audit"]["seq"], m["audit"]["hash"]):
        raise BackupError(f"the restored audit head #{head[0]} is not the manifest's #{m['audit']['seq']}")
    pending = _pending_migrations()
    if pending:
        call_command("migrate", interactive=False, verbosity=0)
    if m["l3"].get("note") and m["l3"]["kind"] != "file":
        notes.append(f"L3 ({m['l3']['url']}): {m['l3']['note']}")
    if l3_members and not restore_l3:
        notes.append(f"{len(l3_members)} L3 objects were left out (--no-l3)")
    audit_record(actor=actor, action="backup.restore", target=Path(path).name[:255],
                 new={"manifest_sha256": archive.manifest_sha256, "backup_created": m["created"],
                      "audit_seq": m["audit"]["seq"], "l3_objects": written, "forced": force})
    verify = audit_verify()
    if not verify["ok"]:
        raise BackupError(f"the restored audit chain does not verify: {verify['problem']}")
    return RestoreResult(archive.manifest_sha256, m, {name: a.action for name, a in actions.items()}, written,
                         pending, verify, notes)
