"""The serving API's one table: the access generation (``serving.access_generation``)."""

from django.db import models


class AccessGeneration(models.Model):
    """One row (id 1): moved by database triggers on every change to what admission reads."""

    value = models.BigIntegerField(default=0)

    class Meta:
        db_table = "serving_accessgeneration"
