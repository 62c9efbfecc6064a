"""Forms of the tenant pages (``tenant_views``). They check shape only (types, ranges, lengths,
choices, typed confirmations); the services validate meaning, and :func:`apply_service_error` puts
an ``ApplicationError`` they raise next to the field it is about (or above the form)."""

from __future__ import annotations

import re
import secrets

from django import forms

from controlplane.common.errors import ApplicationError
from controlplane.tenants import quotas as quota_registry
from controlplane.tenants.models import (
    RETENTION_DEFAULT_SECONDS,
    RETENTION_MAX_SECONDS,
    Tenant,
    slug_validator,
)
from controlplane.tenants.quotas import QuotaSpec

REASON_MAX = 1000  # the admin API's limit (``TenantPatchIn.reason``)
QUOTAS_HERE = "*quotas"  # in a form's ``field_order``: where the registry's quota fields go


def quota_field(spec: QuotaSpec) -> forms.Field:
    """A quota's form field from the registry: blank = null; its label, help text and range (a refused
    0 says why, as the services do)."""
    field = forms.IntegerField if spec.value_type is int else forms.FloatField
    return field(
        required=False, min_value=spec.minimum, max_value=spec.upper, label=spec.label, help_text=spec.hint,
        error_messages={"min_value": f"Ensure this value is greater than or equal to %(limit_value)s{spec.zero_hint}."},
        widget=forms.NumberInput(attrs={"class": "num-input", "placeholder": "—"}))


def _reason(placeholder: str = "recorded in the audit log") -> forms.CharField:
    return forms.CharField(required=False, max_length=REASON_MAX, label="Reason",
                           widget=forms.TextInput(attrs={"placeholder": placeholder, "size": 30}))


def _slug_field(label: str) -> forms.CharField:
    return forms.CharField(max_length=63, validators=[slug_validator], label=label,
                           help_text="a-z, 0-9 and '-'",
                           widget=forms.TextInput(attrs={"size": 16, "autocomplete": "off", "spellcheck": "false"}))


def _name_field(label: str = "Name") -> forms.CharField:
    return forms.CharField(max_length=200, label=label, widget=forms.TextInput(attrs={"size": 24}))


class QuotaPolicyMixin(forms.Form):
    """The registry's quotas (blank = unlimited / worker default), at ``QUOTAS_HERE`` in the form's
    ``field_order``, and the cache policy."""

    persist = forms.BooleanField(required=False, initial=True, label="Persist KV to L3",
                                 help_text="may this tenant's KV be written to and read from the remote store; "
                                           "turning it off deletes the tenant's L3 objects (a job)")
    retention_seconds = forms.IntegerField(min_value=0, max_value=RETENTION_MAX_SECONDS,
                                           initial=RETENTION_DEFAULT_SECONDS, label="Retention (seconds)",
                                           help_text=f"0-{RETENTION_MAX_SECONDS:,}; 86,400 = 24 h; lowering it "
                                                     "deletes L3 objects now too old (a job)",
                                           widget=forms.NumberInput(attrs={"class": "num-input"}))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for spec in quota_registry.QUOTAS:
            self.fields[spec.name] = quota_field(spec)
        names = quota_registry.names()
        self.order_fields([n for item in self.field_order for n in (names if item == QUOTAS_HERE else [item])])

    def quotas(self) -> dict[str, int | float | None]:
        return {name: self.cleaned_data.get(name) for name in quota_registry.names()}

    def cache_policy(self) -> dict[str, bool | int]:
        return {"persist": bool(self.cleaned_data.get("persist")),
                "retention_seconds": self.cleaned_data["retention_seconds"]}


class TenantCreateForm(QuotaPolicyMixin):
    slug = _slug_field("Slug")
    name = _name_field()
    field_order = ["slug", "name", QUOTAS_HERE, "persist", "retention_seconds"]


class TenantSettingsForm(QuotaPolicyMixin):
    name = _name_field()
    reason = _reason()
    field_order = ["name", QUOTAS_HERE, "persist", "retention_seconds", "reason"]

    @classmethod
    def for_tenant(cls, tenant: Tenant, **kwargs) -> TenantSettingsForm:
        initial = {"name": tenant.name, **tenant.quotas, "persist": tenant.persist_kv,
                   "retention_seconds": tenant.retention_seconds}
        return cls(initial=initial, **kwargs)


class KeyCreateForm(forms.Form):
    """``once`` is a fresh random value per rendered form: the view refuses to run one twice, so
    reloading the page that showed a new key neither shows it again nor makes another one."""

    name = forms.CharField(required=False, max_length=100, label="Key name",
                           widget=forms.TextInput(attrs={"placeholder": "e.g. production", "size": 18}))
    once = forms.CharField(max_length=64, widget=forms.HiddenInput)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("initial", {"once": secrets.token_urlsafe(16)})
        super().__init__(*args, **kwargs)


class ReasonForm(forms.Form):
    reason = _reason()


class GrantForm(forms.Form):
    model = forms.ChoiceField(label="Model")

    def __init__(self, *args, models: list[str] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["model"].choices = [(m, m) for m in models]


class ShareGroupJoinForm(forms.Form):
    group = forms.ChoiceField(label="Share group")
    reason = _reason()

    def __init__(self, *args, groups: list[tuple[str, str]] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["group"].choices = list(groups)


class ShareGroupCreateForm(forms.Form):
    slug = _slug_field("Group slug")
    name = _name_field("Group name")


class TypedConfirmForm(forms.Form):
    """A destructive action: the operator types ``expected`` (a slug, a version number)."""

    confirm = forms.CharField(max_length=100, label="Confirm",
                              widget=forms.TextInput(attrs={"autocomplete": "off", "spellcheck": "false"}))
    reason = _reason()

    def __init__(self, *args, expected: str, what: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.expected = expected
        self.fields["confirm"].label = f"Type {what} to confirm"
        self.fields["confirm"].help_text = f"type {expected}"

    def clean_confirm(self) -> str:
        value = self.cleaned_data["confirm"].strip()
        if value != self.expected:
            raise forms.ValidationError(f"Type {self.expected} exactly to confirm.")
        return value


def _field_for(form: forms.Form, message: str) -> str | None:
    """The form field an error message is about, if any (service messages name their field:
    ``"quota max_l3_bytes must..."``, ``"cache_policy.persist must..."``, ``"name must..."``,
    ``"slug: use 1-63..."``, ``"tenant 'x' already exists"``)."""
    for name in form.fields:
        if re.search(rf"(?:^|[\s.(]){re.escape(name)}(?:[\s:]|$)", message):
            return name
    if "persist" in form.fields and "cache_policy.persist" in message:
        return "persist"
    if "slug" in form.fields and "already exists" in message:
        return "slug"
    return None


def apply_service_error(form: forms.Form, exc: ApplicationError) -> None:
    """Show a service's refusal on ``form``: next to the field it names, else above the form."""
    field = _field_for(form, exc.message)
    form.add_error(field if field in form.fields and field not in form.errors else None, exc.message)
