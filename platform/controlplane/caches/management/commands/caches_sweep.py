"""``manage.py caches_sweep``: one named-cache sweep now (``caches.services.caches_sweep``), for a
deployment whose web processes do not run the sweep thread (``caches.sweeper``); prints what it cleared
as JSON."""

import dataclasses
import json

from django.core.management.base import BaseCommand

from controlplane.caches.services import caches_sweep
from controlplane.common.actor import Actor


class Command(BaseCommand):
    help = ("Clear the token ids and messages of expired and deleted named caches (audited in aggregate); "
            "prints {caches, expired, deleted, tokens, tenants} as JSON.")

    def handle(self, *args, **options):
        result = caches_sweep(actor=Actor.cli())
        self.stdout.write(json.dumps(dataclasses.asdict(result)))
