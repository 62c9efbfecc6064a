"""``manage.py strata_backup PATH [--no-l3]``: one archive of the database, the keys, the audit head
log and a file:// L3 (``controlplane.backups``). Refuses an existing PATH; exit status 1 on failure."""

import getpass
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from controlplane.backups.manifest import BackupError
from controlplane.backups.services import backup_create
from controlplane.common.actor import Actor


class Command(BaseCommand):
    help = "Back up the database, key files, audit head log and a file:// L3 into one new archive (mode 0600)."

    def add_arguments(self, parser):
        parser.add_argument("path", type=Path, help="the archive to create (never overwritten)")
        parser.add_argument("--no-l3", action="store_true", help="leave the L3 objects out (a cache)")

    def handle(self, *args, **options):
        try:
            result = backup_create(actor=Actor.cli(getpass.getuser()), path=options["path"],
                                   include_l3=not options["no_l3"])
        except BackupError as exc:
            raise CommandError(str(exc)) from None
        m = result.manifest
        self.stdout.write(f"backup written: {result.path} ({result.size} bytes, mode 0600)")
        self.stdout.write(f"manifest sha256: {result.manifest_sha256}")
        self.stdout.write(f"database: {m['database']['vendor']} ({m['database']['tool']}); "
                          f"audit head #{m['audit']['seq']}, {m['audit']['length']} events")
        for name, entry in m["keys"].items():
            state = ("archived" if entry["member"] else
                     f"NOT archived (from the environment; fingerprint {entry['fingerprint']})"
                     if entry["source"] == "env" else "none")
            self.stdout.write(f"{name} key: {state}")
        l3 = m["l3"]
        self.stdout.write(f"L3 ({l3['url']}): {l3['objects']} objects, {l3['bytes']} bytes"
                          + (f"; {l3['note']}" if l3["note"] else ""))
        self.stdout.write("keep the archive as secret as the keys it holds: with them it opens every tenant's L3 data")
