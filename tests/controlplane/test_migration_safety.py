"""Every migration is one the previous release's processes survive, or is reviewed here by name.

During a rolling upgrade the new release's migrations run (the migrate Job, ``manage.py migrate``)
while the previous release's web, Celery and sampler processes still serve, reading and writing the
tables with the SQL their own models produce: every column they know, named in each SELECT and
INSERT. docs/upgrades.md ("Migrations") states which operations they survive; this test holds every
migration of the control plane to it, reading the migration files (nothing is applied):

- survivable: ``CreateModel``; ``AddIndex``; ``RunPython``; ``AlterModelOptions``; an ``AddField``
  that is nullable or has a ``db_default`` (the database fills the column for the previous release's
  INSERTs, which do not name it; a plain ``default=`` is Django's alone: it drops the column's default
  right after adding it, so those INSERTs fail ``NOT NULL``); an ``AlterField`` that changes nothing
  in the database (choices, help text: Django's own ``non_db_attrs``); and anything on a model created
  in the same migration (the previous release never touches that table);
- anything else (``RemoveField``, ``DeleteModel``, renames, a ``NOT NULL`` ``AddField`` without
  ``db_default``, an ``AlterField`` that changes the column, ``RunSQL``, constraints on existing
  tables) must be in :data:`REVIEWED` with what the previous release met while it ran.
"""

from __future__ import annotations

import pytest
from django.db import migrations
from django.db.models.fields import NOT_PROVIDED

ALWAYS_SURVIVABLE = (migrations.CreateModel, migrations.AddIndex, migrations.RunPython,
                     migrations.AlterModelOptions, migrations.AlterModelManagers)

# (app, migration) -> what the previous release's processes met while it ran. These four predate the
# rule: each added a NOT NULL column with a Python-side default to a table the previous release
# inserted into, so its inserts into that table failed from the migration until it stopped serving.
REVIEWED = {
    ("registry", "0002_replicas_and_checkpoints"):
        "replicas NOT NULL: the previous release's model creation failed during the window; the "
        "re-created weights-source check admits every row it writes (checkpoint_path stays NULL)",
    ("registry", "0003_engine_and_tensor_parallel"):
        "engine and tensor_parallel_size NOT NULL: the previous release's model creation failed during the window",
    ("registry", "0004_soft_delete"):
        "the unique index on a deployment's name is replaced by one on names not purged, added first: the "
        "previous release's inserts leave purged_at NULL, so every name it writes stays unique; it deletes "
        "nothing, so it never meets a deleted row it would show",
    ("adapters", "0002_live_name_unique"):
        "an adapter's name is unique among live rows instead of rows not deleted, the new index added in the "
        "same transaction as the old one goes: every name the previous release wrote is live or deleting, "
        "and it never makes a second row of a name, so its rows satisfy both",
    ("tenants", "0003_data_keys_and_cache_policy"):
        "persist_kv and retention_seconds NOT NULL: the previous release's tenant creation failed during the "
        "window; the retention check holds for the default it gets (86400)",
    ("timeseries", "0002_sample_replica"):
        "replica NOT NULL: the previous release's sampler could not insert samples during the window; the "
        "re-created unique key includes replica, which its rows leave at 0",
}


def _changes_database(old, new) -> bool:
    """Whether ``AlterField`` from ``old`` to ``new`` alters the column (Django's own test, without
    a connection: the deconstructed fields differ in more than their ``non_db_attrs``)."""
    _, old_path, old_args, old_kwargs = old.deconstruct()
    _, new_path, new_args, new_kwargs = new.deconstruct()
    for attr in old.non_db_attrs:
        old_kwargs.pop(attr, None)
    for attr in new.non_db_attrs:
        new_kwargs.pop(attr, None)
    return (old_path, old_args, old_kwargs) != (new_path, new_args, new_kwargs)


def unsurvivable(loader, key) -> list[str]:
    """The operations of migration ``key`` that the previous release's processes would not survive."""
    migration = loader.disk_migrations[key]
    before = loader.project_state(key, at_end=False)
    created = {op.name_lower for op in migration.operations if isinstance(op, migrations.CreateModel)}
    found = []
    for op in migration.operations:
        model = getattr(op, "model_name_lower", None) or getattr(op, "name_lower", None)
        if isinstance(op, ALWAYS_SURVIVABLE) or model in created:
            continue
        if isinstance(op, migrations.AddField):
            if op.field.null or op.field.db_default is not NOT_PROVIDED or op.field.many_to_many:
                continue
            found.append(f"AddField {op.model_name}.{op.name}: NOT NULL without db_default")
        elif isinstance(op, migrations.AlterField):
            old = before.models[key[0], op.model_name_lower].fields[op.name]
            if not _changes_database(old, op.field):
                continue
            found.append(f"AlterField {op.model_name}.{op.name}: changes the column")
        else:
            found.append(op.describe())
    return found


@pytest.fixture(scope="module")
def loader():
    from django.apps import apps
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    ours = {config.label for config in apps.get_app_configs() if config.name.startswith("controlplane.")}
    loader.ours = sorted(key for key in loader.disk_migrations if key[0] in ours)
    return loader


def test_every_migration_is_survivable_by_the_previous_release_or_reviewed(loader):
    problems = {key: ops for key in loader.ours if (ops := unsurvivable(loader, key)) and key not in REVIEWED}
    assert not problems, (
        "migrations the previous release's processes would not survive (make the column nullable or give it "
        "db_default=, split a removal or rename over two releases: docs/upgrades.md), or review them in REVIEWED: "
        + "; ".join(f"{app}.{name}: {', '.join(ops)}" for (app, name), ops in sorted(problems.items())))
    stale = [key for key in REVIEWED if key not in loader.ours or not unsurvivable(loader, key)]
    assert not stale, f"REVIEWED entries that name no such migration, or a survivable one: {stale}"


def test_the_rule_tells_a_python_default_from_a_database_default(loader):
    """The paired check: a NOT NULL column with ``default=`` is flagged, the same with ``db_default=``
    or ``null=True`` is not (the rule is not vacuous)."""
    from django.db import models
    from django.db.migrations.loader import MigrationLoader

    key = loader.ours[0]
    model = next(op.name_lower for op in loader.disk_migrations[key].operations
                 if isinstance(op, migrations.CreateModel))
    target = (key[0], "9999_probe")
    cases = {"python default": models.IntegerField(default=1), "db_default": models.IntegerField(db_default=1),
             "nullable": models.IntegerField(null=True)}
    verdicts = {}
    for label, field in cases.items():
        fresh = MigrationLoader(None, ignore_no_migrations=True)
        probe = type("Migration", (migrations.Migration,), {
            "dependencies": [key], "operations": [migrations.AddField(model_name=model, name="probe", field=field)]})
        fresh.disk_migrations[target] = probe(target[1], target[0])
        fresh.graph.add_node(target, fresh.disk_migrations[target])
        fresh.graph.add_dependency(target, target, key)
        verdicts[label] = bool(unsurvivable(fresh, target))
    assert verdicts == {"python default": True, "db_default": False, "nullable": False}
