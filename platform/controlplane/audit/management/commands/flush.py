"""``flush`` that respects the append-only audit log.

Django's ``flush`` empties every table, which the audit triggers refuse. Outside tests that is the
right answer, so this command refuses too; with ``STRATA_AUDIT_ALLOW_FLUSH`` (test settings only:
``TransactionTestCase`` flushes between tests) it drops the triggers around the flush and puts them
back, and writes a ``reset`` line to the external head log (the emptied log starts again at 0).
It first waits for this process's pending accounting (``serving.accountant.drain``): a request
answered just before would otherwise write its ledger batch into the tables being truncated, and
the two deadlock (the batch holds its rows' locks and waits for the tenant's; ``TRUNCATE`` the reverse).
"""

from django.conf import settings
from django.core.management.base import CommandError
from django.core.management.commands.flush import Command as DjangoFlush
from django.db import connections

from controlplane.audit import triggers
from controlplane.audit.headlog import head_log_append
from controlplane.audit.models import GENESIS_HASH


class Command(DjangoFlush):
    def handle(self, **options):
        if not settings.STRATA_AUDIT_ALLOW_FLUSH:
            raise CommandError("refusing to flush: the audit log is append-only")
        from controlplane.serving import accountant

        accountant.drain()
        with triggers.suspended(connections[options["database"]]):
            result = super().handle(**options)
        head_log_append(seq=0, hash=GENESIS_HASH, kind="reset", using=options["database"])
        return result
