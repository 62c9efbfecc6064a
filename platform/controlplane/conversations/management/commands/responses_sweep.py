"""``manage.py responses_sweep``: one sweep of expired stored responses now
(``conversations.services.responses_sweep``); prints what it deleted as JSON."""

import dataclasses
import json

from django.core.management.base import BaseCommand

from controlplane.common.actor import Actor
from controlplane.conversations.services import responses_sweep


class Command(BaseCommand):
    help = "Delete stored responses past their tenant's retention; prints {responses, tenants} as JSON."

    def handle(self, *args, **options):
        self.stdout.write(json.dumps(dataclasses.asdict(responses_sweep(actor=Actor.cli()))))
