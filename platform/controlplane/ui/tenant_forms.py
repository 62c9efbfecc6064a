"""Forms of the tenant pages (``tenant_views``). They check shape only (types, ranges, lengths,
choices, typed confirmations); the services validate meaning, and :func:`apply_service_error` puts
an ``ApplicationError`` they raise next to the field it is about (or above the form)."""

from __future__ import annotations

import re
import secrets

from django import forms

from controlplane.common.errors import ApplicationError
from controlplane.tenants.models import (
    QUOTA_FIELDS,
    RETENTION_DEFAULT_SECONDS,
    RETENTION_MAX_SECONDS,
    Tenant,
    slug_validator,
)
from controlplane.tenants.services import QUOTA_MAX, QUOTA_MIN, QUOTA_ZERO_HINT
from workers.admission import DEFAULT_TENANT_CONCURRENCY

REASON_MAX = 1000  # the admin API's limit (``TenantPatchIn.reason``)
QUOTA_LABELS = {
    "requests_per_minute": ("Requests / minute", "blank = unlimited"),
    "tokens_per_minute": ("Tokens / minute", "blank = unlimited"),
    "max_cached_tokens": ("Max cached tokens", "blank = unlimited"),
    "max_prompt_tokens": ("Max prompt tokens", "blank = unlimited"),
    "max_l3_bytes": ("Max L3 bytes", "blank = unlimited"),
    "max_inflight_tokens": ("In-flight tokens", "per worker; blank = worker default"),
    "max_concurrent_requests": ("Concurrent requests", "per worker, completions and KV calls; blank = worker "
                                f"default ({DEFAULT_TENANT_CONCURRENCY})"),
    "share_weight": ("Share weight", "of each worker's cache and compute, 1-100; blank = 1 (equal shares)"),
    "max_pinned_tokens": ("Pinned tokens", "of named caches, soft-pinned in L2/L3; blank = 0 (none)"),
}


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
    """The seven quotas (blank = unlimited / worker default) and the cache policy."""

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
        for name in QUOTA_FIELDS:
            label, hint = QUOTA_LABELS[name]
            self.fields[name] = forms.IntegerField(
                required=False, min_value=QUOTA_MIN.get(name, 0), max_value=QUOTA_MAX[name], label=label,
                help_text=hint, error_messages={"min_value": "Ensure this value is greater than or equal to "
                                                             f"%(limit_value)s{QUOTA_ZERO_HINT.get(name, '')}."},
                widget=forms.NumberInput(attrs={"class": "num-input", "placeholder": "—"}))
        self.order_fields(self.field_order)

    def quotas(self) -> dict[str, int | None]:
        return {name: self.cleaned_data.get(name) for name in QUOTA_FIELDS}

    def cache_policy(self) -> dict[str, bool | int]:
        return {"persist": bool(self.cleaned_data.get("persist")),
                "retention_seconds": self.cleaned_data["retention_seconds"]}


class TenantCreateForm(QuotaPolicyMixin):
    slug = _slug_field("Slug")
    name = _name_field()
    field_order = ["slug", "name", *QUOTA_FIELDS, "persist", "retention_seconds"]


class TenantSettingsForm(QuotaPolicyMixin):
    name = _name_field()
    reason = _reason()
    field_order = ["name", *QUOTA_FIELDS, "persist", "retention_seconds", "reason"]

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
