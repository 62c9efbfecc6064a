"""Django admin: the audit log is view-only (rows can never be added, changed or deleted here)."""

from django.contrib import admin

from controlplane.audit.models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ("seq", "time", "actor", "auth_method", "action", "target", "tenant", "result")
    list_filter = ("action", "result", "auth_method")
    search_fields = ("actor", "target", "tenant", "action")
    ordering = ("-seq",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
