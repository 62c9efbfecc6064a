"""Form parsing for the UI's writes. Forms only check shape (types, lengths, choices); the services
validate meaning and raise ``ApplicationError``, which the views show next to the form."""

from __future__ import annotations

from django import forms

from controlplane.jobs.models import FlushJob
from controlplane.tenants.models import Tenant

REASON_MAX = 2000


class TenantStatusForm(forms.Form):
    status = forms.ChoiceField(choices=[(Tenant.Status.ACTIVE, "active"), (Tenant.Status.SUSPENDED, "suspended")])
    reason = forms.CharField(required=False, max_length=REASON_MAX)


class RevisionForm(forms.Form):
    label = forms.CharField(max_length=64, widget=forms.TextInput(attrs={"placeholder": "r2", "size": 10}))
    seed = forms.IntegerField(min_value=0, widget=forms.NumberInput(attrs={"placeholder": "42", "class": "seed"}))


class RolloutForm(forms.Form):
    revision = forms.CharField(max_length=64)
    reason = forms.CharField(required=False, max_length=REASON_MAX,
                             widget=forms.TextInput(attrs={"placeholder": "new weights"}))


class FlushForm(forms.Form):
    scope = forms.ChoiceField(choices=FlushJob.Scope.choices)
    tenant = forms.CharField(required=False, max_length=63, widget=forms.Select)
    model = forms.CharField(required=False, max_length=100, widget=forms.Select)
    revision = forms.CharField(required=False, max_length=64,
                               widget=forms.TextInput(attrs={"placeholder": "label, e.g. r1", "size": 12}))
    reason = forms.CharField(max_length=REASON_MAX, widget=forms.TextInput(attrs={"size": 40}))

    def __init__(self, *args, tenants: list[str] = (), models: list[str] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["tenant"].widget.choices = [("", "—"), *((s, s) for s in tenants)]
        self.fields["model"].widget.choices = [("", "—"), *((m, m) for m in models)]
        self.fields["scope"].help_text = "what to flush"
        self.fields["reason"].help_text = "recorded in the audit log"
        self.fields["tenant"].help_text = "for scope tenant"
        self.fields["model"].help_text = "for scope model or revision"
        self.fields["revision"].help_text = "for scope revision"

    def service_kwargs(self) -> dict:
        data = self.cleaned_data
        return {"scope": data["scope"], "reason": data["reason"], "tenant": data["tenant"] or None,
                "model": data["model"] or None, "revision": data["revision"] or None}


def form_error_text(form: forms.Form) -> str:
    """All of a form's errors as one line (for a page-level message)."""
    parts = []
    for field, errors in form.errors.items():
        label = "" if field == "__all__" else f"{field}: "
        parts.extend(f"{label}{e}" for e in errors)
    return "; ".join(parts)
