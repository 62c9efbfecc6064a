"""``manage.py create_operator_token --username NAME --role admin|viewer [--expires-days N]``.

Prints a short notice, then the new token alone on the last line (scripts take ``tail -n1``).
"""

import getpass

from django.core.management.base import BaseCommand, CommandError

from controlplane.common.actor import Actor
from controlplane.common.errors import ApplicationError
from controlplane.operators.models import OperatorToken
from controlplane.operators.services import operator_token_create


class Command(BaseCommand):
    help = "Create an operator token for the admin API and print it (shown only this once)."

    def add_arguments(self, parser):
        parser.add_argument("--username", required=True)
        parser.add_argument("--role", required=True, choices=OperatorToken.Role.values)
        parser.add_argument("--expires-days", type=int, default=None,
                            help="days until it stops working (1-3650; default STRATA_OPERATOR_TOKEN_DAYS, 90)")

    def handle(self, *args, **options):
        try:
            token, raw = operator_token_create(
                actor=Actor.cli(getpass.getuser()), username=options["username"], role=options["role"],
                expires_days=options["expires_days"],
            )
        except ApplicationError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"operator token for {token.username} (role {token.role}, prefix {token.prefix}, "
                          f"expires {token.expires_at:%Y-%m-%d %H:%M} UTC); "
                          "store it now, it is not shown again:")
        self.stdout.write(raw)
