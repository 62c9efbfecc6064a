from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0002_shred_jobs'),
    ]

    operations = [
        migrations.AlterField(
            model_name='flushjob',
            name='kind',
            field=models.CharField(choices=[('flush', 'Flush'), ('rollout', 'Rollout'), ('offboard', 'Offboard'), ('shred', 'Shred'), ('l3_delete', 'L3 Delete'), ('l3_expire', 'L3 Expire')], default='flush', max_length=16),
        ),
    ]
