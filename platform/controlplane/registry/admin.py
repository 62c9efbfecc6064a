"""Django admin: read-only views of deployments and revisions (changes go through the admin API so
they are validated and audited)."""

from django.contrib import admin

from controlplane.common.admin import ReadOnlyAdmin
from controlplane.registry.models import ModelDeployment, ModelRevision


class RevisionInline(admin.TabularInline):
    model = ModelRevision
    fields = ("label", "seed", "weights_path", "digest", "created")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(ModelDeployment)
class ModelDeploymentAdmin(ReadOnlyAdmin):
    list_display = ("name", "preset", "architecture", "tokenizer", "active_revision", "created")
    search_fields = ("name",)
    inlines = [RevisionInline]
