"""Base for Strata's Django admin pages: view-only, because every change must go through a service
(validated and audited) and the admin site would bypass both."""

from django.contrib import admin


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
