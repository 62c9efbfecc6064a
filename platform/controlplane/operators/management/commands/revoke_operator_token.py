"""``manage.py revoke_operator_token --prefix st-op-XXXXXXXX``: revoke tokens with that prefix."""

import getpass

from django.core.management.base import BaseCommand, CommandError

from controlplane.common.actor import Actor
from controlplane.operators.models import OperatorToken
from controlplane.operators.services import operator_token_revoke


class Command(BaseCommand):
    help = "Revoke the operator token(s) with the given visible prefix."

    def add_arguments(self, parser):
        parser.add_argument("--prefix", required=True)

    def handle(self, *args, **options):
        tokens = list(OperatorToken.objects.filter(prefix=options["prefix"], revoked_at__isnull=True))
        if not tokens:
            raise CommandError(f"no live operator token with prefix {options['prefix']!r}")
        for token in tokens:
            operator_token_revoke(actor=Actor.cli(getpass.getuser()), token=token)
            self.stdout.write(f"revoked {token.prefix} ({token.username})")
