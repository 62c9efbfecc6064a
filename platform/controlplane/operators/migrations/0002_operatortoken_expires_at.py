from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("operators", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="operatortoken",
            name="expires_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
