"""Django admin: read-only views. Scope salts and key hashes are never displayed (not in any field
list); the scope appears as its fingerprint only."""

from django.contrib import admin

from controlplane.common.admin import ReadOnlyAdmin
from controlplane.tenants import quotas
from controlplane.tenants.models import ApiKey, Grant, ShareGroup, Tenant
from controlplane.tenants.selectors import scope_fingerprint


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    fields = ("prefix", "name", "created", "last_used", "revoked_at")
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(Tenant)
class TenantAdmin(ReadOnlyAdmin):
    list_display = ("slug", "name", "status", "share_group", "requests_per_minute", "tokens_per_minute", "created")
    list_filter = ("status",)
    search_fields = ("slug", "name")
    fields = ("slug", "name", "status", "share_group", "fingerprint", *quotas.names(), "created", "updated")
    readonly_fields = fields
    inlines = [ApiKeyInline]

    @admin.display(description="scope fingerprint")
    def fingerprint(self, obj: Tenant) -> str:
        return scope_fingerprint(obj.share_group.scope_salt if obj.share_group_id else obj.scope_salt)


@admin.register(ShareGroup)
class ShareGroupAdmin(ReadOnlyAdmin):
    list_display = ("slug", "name", "created")
    fields = ("slug", "name", "fingerprint", "created")
    readonly_fields = fields

    @admin.display(description="scope fingerprint")
    def fingerprint(self, obj: ShareGroup) -> str:
        return scope_fingerprint(obj.scope_salt)


@admin.register(ApiKey)
class ApiKeyAdmin(ReadOnlyAdmin):
    list_display = ("prefix", "tenant", "name", "created", "last_used", "revoked_at")
    fields = ("prefix", "tenant", "name", "created", "last_used", "revoked_at")
    readonly_fields = fields
    search_fields = ("prefix", "tenant__slug")


@admin.register(Grant)
class GrantAdmin(ReadOnlyAdmin):
    list_display = ("tenant", "deployment", "created")
