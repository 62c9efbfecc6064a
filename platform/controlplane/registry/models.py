"""ModelDeployment (what tenants name in requests) and ModelRevision (one set of weights).

A revision's weights come from exactly one source: a ``seed`` (demo/test weights derived from model
name + label + seed), a ``weights_path`` (safetensors file of a preset's layout) or a
``checkpoint_path`` (a Hugging Face checkpoint directory: config, safetensors, tokenizer, chat
template). ``digest`` identifies the weights and goes into the cache namespace, so a new revision
never hits the old one's cache. A deployment runs ``replicas`` cache workers, each serving through
its ``engine`` (``strata`` or ``vllm``, chosen at creation: ``registry.engines``) over
``tensor_parallel_size`` devices.

Deletes are soft, because jobs keep their deployment and revisions (PROTECT): a deleted row has
``deleted_at`` set and is gone for everyone at once, since the default manager (``objects``) hides
it: tenants, selectors, lists, grants and jobs' lookups never see it (``all_objects`` does, for the
delete jobs). A deployment's name stays taken while its delete job runs (its replicas and L3
objects are named after it); the job sets ``purged_at`` when it succeeded, and the name may then be
used again (names are unique among rows not purged). A deleted revision's label is never reused
within its deployment.
"""

from __future__ import annotations

from django.core.validators import RegexValidator
from django.db import models

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
name_validator = RegexValidator(NAME_PATTERN, "use 1-100 characters A-Z, a-z, 0-9, '.', '_' and '-'")
LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
label_validator = RegexValidator(LABEL_PATTERN, "use 1-64 characters A-Z, a-z, 0-9, '.', '_' and '-'")


class LiveManager(models.Manager):
    """Rows not deleted (``deleted_at`` unset): the default manager of deployments and revisions."""

    def get_queryset(self):
        return super().get_queryset().filter(deleted_at__isnull=True)


class ModelDeployment(models.Model):
    class Engine(models.TextChoices):
        STRATA = "strata", "Strata"
        VLLM = "vllm", "vLLM"

    name = models.CharField(max_length=100, validators=[name_validator])
    preset = models.CharField(max_length=32)
    architecture = models.CharField(max_length=32, default="llama")
    tokenizer = models.CharField(max_length=64, default="byte")
    replicas = models.PositiveSmallIntegerField(default=1)
    engine = models.CharField(max_length=16, choices=Engine.choices, default=Engine.STRATA)
    tensor_parallel_size = models.PositiveSmallIntegerField(default=1)
    active_revision = models.ForeignKey(
        "ModelRevision", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True)  # DELETE asked: hidden from then on
    purged_at = models.DateTimeField(null=True, blank=True)  # its delete job succeeded: the name is free

    objects = LiveManager()
    all_objects = models.Manager()

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(fields=["name"], condition=models.Q(purged_at__isnull=True),
                                    name="deployment_unique_name"),
        ]

    def __str__(self) -> str:
        return self.name


class ModelRevision(models.Model):
    deployment = models.ForeignKey(ModelDeployment, on_delete=models.CASCADE, related_name="revisions")
    label = models.CharField(max_length=64, validators=[label_validator])
    seed = models.BigIntegerField(null=True, blank=True)
    weights_path = models.CharField(max_length=1024, null=True, blank=True)
    checkpoint_path = models.CharField(max_length=1024, null=True, blank=True)
    digest = models.CharField(max_length=64)
    created = models.DateTimeField(auto_now_add=True)
    deleted_at = models.DateTimeField(null=True, blank=True)  # DELETE asked: hidden, its KV being flushed

    objects = LiveManager()
    all_objects = models.Manager()

    class Meta:
        ordering = ["deployment_id", "id"]
        constraints = [
            models.UniqueConstraint(fields=["deployment", "label"], name="revision_unique_label"),
            models.CheckConstraint(
                condition=(
                    models.Q(seed__isnull=False, weights_path__isnull=True, checkpoint_path__isnull=True)
                    | models.Q(seed__isnull=True, weights_path__isnull=False, checkpoint_path__isnull=True)
                    | models.Q(seed__isnull=True, weights_path__isnull=True, checkpoint_path__isnull=False)
                ),
                name="revision_one_weights_source",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.deployment_id}@{self.label}"

    @property
    def source(self) -> str:
        if self.seed is not None:
            return "seed"
        return "checkpoint" if self.checkpoint_path else "file"
