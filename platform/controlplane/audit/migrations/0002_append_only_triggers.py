"""Make audit_auditevent append-only in the database itself (see controlplane.audit.triggers)."""

from django.db import migrations


def install(apps, schema_editor):
    from controlplane.audit import triggers

    triggers.install(schema_editor.connection)


def uninstall(apps, schema_editor):
    from controlplane.audit import triggers

    triggers.uninstall(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [("audit", "0001_initial")]

    operations = [migrations.RunPython(install, uninstall)]
