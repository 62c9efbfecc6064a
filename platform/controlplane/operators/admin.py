"""Django admin: operator tokens by prefix (never the hash), read-only; the login form is throttled
and audited; user accounts' privileges are read-only here.

Strata's roles come from two flags of a Django user: ``is_staff`` (an operator: viewer) and
``is_superuser`` (admin). The admin's User pages therefore show ``is_staff``, ``is_superuser``,
``is_active``, groups and permissions read-only, and only superusers may change users at all (a
viewer with a stray permission cannot reset an admin's password). Privileges change through
``accounts.user_privileges_set`` (audited); any other change is still audited by the
``signals`` backstop. Groups are read-only (their permissions would reach their members).
"""

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group

from controlplane.common.admin import ReadOnlyAdmin
from controlplane.operators.forms import AdminLoginForm
from controlplane.operators.models import OperatorToken

admin.site.login_form = AdminLoginForm

PRIVILEGE_FIELDS = ("is_active", "is_staff", "is_superuser", "groups", "user_permissions")


@admin.register(OperatorToken)
class OperatorTokenAdmin(ReadOnlyAdmin):
    list_display = ("prefix", "username", "role", "created", "last_used", "revoked_at")
    fields = ("prefix", "username", "role", "created", "last_used", "revoked_at")
    readonly_fields = fields
    list_filter = ("role",)


User = get_user_model()
if admin.site.is_registered(User):
    admin.site.unregister(User)


@admin.register(User)
class StrataUserAdmin(UserAdmin):
    readonly_fields = (*PRIVILEGE_FIELDS, "last_login", "date_joined")

    def has_add_permission(self, request):
        return request.user.is_superuser

    def has_change_permission(self, request, obj=None):
        return request.user.is_superuser

    def has_delete_permission(self, request, obj=None):
        return False  # deactivating goes through user_privileges_set, audited


if admin.site.is_registered(Group):
    admin.site.unregister(Group)


@admin.register(Group)
class StrataGroupAdmin(ReadOnlyAdmin, GroupAdmin):
    pass
