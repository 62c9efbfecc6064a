"""The access generation's row table and its triggers (``controlplane.serving.access_generation``)."""

from django.db import migrations, models


def install(apps, schema_editor):
    from controlplane.serving import access_generation

    access_generation.install(schema_editor.connection)


def uninstall(apps, schema_editor):
    from controlplane.serving import access_generation

    access_generation.uninstall(schema_editor.connection)


class Migration(migrations.Migration):
    initial = True
    dependencies = [("tenants", "0005_tenant_max_pinned_tokens"), ("registry", "0003_engine_and_tensor_parallel")]

    operations = [
        migrations.CreateModel(
            name="AccessGeneration",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("value", models.BigIntegerField(default=0)),
            ],
            options={"db_table": "serving_accessgeneration"},
        ),
        migrations.RunPython(install, uninstall),
    ]
