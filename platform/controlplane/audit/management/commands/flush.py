"""``flush`` that respects the append-only audit log.

Django's ``flush`` empties every table, which the audit triggers refuse. Outside tests that is the
right answer, so this command refuses too; with ``STRATA_AUDIT_ALLOW_FLUSH`` (test settings only:
``TransactionTestCase`` flushes between tests) it drops the triggers around the flush and puts them
back.
"""

from django.conf import settings
from django.core.management.base import CommandError
from django.core.management.commands.flush import Command as DjangoFlush
from django.db import connections

from controlplane.audit import triggers


class Command(DjangoFlush):
    def handle(self, **options):
        if not settings.STRATA_AUDIT_ALLOW_FLUSH:
            raise CommandError("refusing to flush: the audit log is append-only")
        with triggers.suspended(connections[options["database"]]):
            return super().handle(**options)
