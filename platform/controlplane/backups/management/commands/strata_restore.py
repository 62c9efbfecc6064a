"""``manage.py strata_restore PATH [--force] [--no-l3]``: restore an archive of ``strata_backup`` into
this installation (``DATABASE_URL`` / ``STRATA_HOME`` name the target; ``controlplane.backups``).
Checks everything first, refuses a non-empty target without ``--force``, ends with the audit chain
verified. Exit status 1 on failure."""

import getpass
import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from controlplane.backups.manifest import BackupError
from controlplane.backups.services import backup_restore
from controlplane.common.actor import Actor


class Command(BaseCommand):
    help = "Restore a strata_backup archive into this installation's database, STRATA_HOME and L3."

    def add_arguments(self, parser):
        parser.add_argument("path", type=Path, help="the archive strata_backup wrote")
        parser.add_argument("--force", action="store_true",
                            help="replace a database, audit head log and L3 objects that are already there "
                                 "(the master and audit keys are never replaced)")
        parser.add_argument("--no-l3", action="store_true", help="do not restore the archive's L3 objects")

    def handle(self, *args, **options):
        try:
            result = backup_restore(actor=Actor.cli(getpass.getuser()), path=options["path"],
                                    force=options["force"], include_l3=not options["no_l3"])
        except BackupError as exc:
            raise CommandError(str(exc)) from None
        m = result.manifest
        self.stdout.write(f"restored {options['path']} (manifest sha256 {result.manifest_sha256}, made "
                          f"{m['created']} by Strata {m['versions']['strata']} on {m['host']})")
        self.stdout.write(f"database: {m['database']['vendor']}, audit head #{m['audit']['seq']}; "
                          f"{result.migrations_applied} newer migrations applied")
        self.stdout.write("keys: " + ", ".join(f"{name} {action}" for name, action in result.keys.items()))
        self.stdout.write(f"L3: {result.l3_objects} objects written")
        for note in result.notes:
            self.stdout.write(f"note: {note}")
        self.stdout.write("audit chain: " + json.dumps(result.verify))
