"""Guard the chain head in the database and start the external head log.

Reinstalls every audit trigger (``controlplane.audit.triggers``): the head row may now only move
forward, and on SQLite an ``INSERT OR REPLACE`` over an event or the head is refused. Then writes an
``init`` line with the current head to the head log (``controlplane.audit.headlog``), so a database
migrated with events already in it starts being compared from where it stands.
"""

from django.db import migrations


def forward(apps, schema_editor):
    from controlplane.audit import headlog, triggers
    from controlplane.audit.models import GENESIS_HASH

    connection = schema_editor.connection
    triggers.install(connection)
    head = apps.get_model("audit", "AuditHead").objects.using(connection.alias).filter(pk=1).first()
    last = apps.get_model("audit", "AuditEvent").objects.using(connection.alias).order_by("-seq").first()
    seq, hash_ = (head.seq, head.hash) if head else (last.seq, last.hash) if last else (0, GENESIS_HASH)
    headlog.head_log_append(seq=seq, hash=hash_, kind="init", using=connection.alias)


class Migration(migrations.Migration):
    dependencies = [("audit", "0002_append_only_triggers")]

    # Reversing leaves the (stricter) triggers in place; reversing 0002 removes them all.
    operations = [migrations.RunPython(forward, migrations.RunPython.noop)]
