"""Django admin: operator tokens by prefix (never the hash); read-only."""

from django.contrib import admin

from controlplane.common.admin import ReadOnlyAdmin
from controlplane.operators.models import OperatorToken


@admin.register(OperatorToken)
class OperatorTokenAdmin(ReadOnlyAdmin):
    list_display = ("prefix", "username", "role", "created", "last_used", "revoked_at")
    fields = ("prefix", "username", "role", "created", "last_used", "revoked_at")
    readonly_fields = fields
    list_filter = ("role",)
