"""``manage.py audit_verify``: recompute the audit hash chain; exit status 1 when it is broken. The
result is recorded as the chain's last verification (``strata_audit_verify_*`` on ``/metrics``)."""

import json

from django.core.management.base import BaseCommand, CommandError

from controlplane.audit.checks import audit_check_run


class Command(BaseCommand):
    help = "Verify the audit log hash chain and its heads; prints {ok, length, head, first_bad, problem} as JSON."

    def handle(self, *args, **options):
        result = audit_check_run()
        self.stdout.write(json.dumps(result))
        if not result["ok"]:
            raise CommandError(f"audit chain broken at seq {result['first_bad']}: {result['problem']}")
