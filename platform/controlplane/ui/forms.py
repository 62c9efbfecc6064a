"""Form parsing for the UI's writes. Forms only check shape (types, lengths, choices); the services
validate meaning and raise ``ApplicationError``, which the views show next to the form."""

from __future__ import annotations

from django import forms

from controlplane.jobs.models import FlushJob
from controlplane.operators.models import OperatorToken
from controlplane.registry.models import label_validator, name_validator
from controlplane.registry.services import MAX_REPLICAS, MAX_SEED
from controlplane.tenants.models import Tenant

REASON_MAX = 2000


class TenantStatusForm(forms.Form):
    status = forms.ChoiceField(choices=[(Tenant.Status.ACTIVE, "active"), (Tenant.Status.SUSPENDED, "suspended")])
    reason = forms.CharField(required=False, max_length=REASON_MAX)


class RevisionForm(forms.Form):
    """A weight revision: a label and exactly one source, a seed, a weights file (``weights_path``) or a
    Hugging Face checkpoint directory (``path``)."""

    label = forms.CharField(max_length=64, validators=[label_validator],
                            widget=forms.TextInput(attrs={"placeholder": "r2", "size": 10}))
    seed = forms.IntegerField(required=False, min_value=0, max_value=MAX_SEED,
                              widget=forms.NumberInput(attrs={"placeholder": "42", "class": "seed"}))
    weights_path = forms.CharField(required=False, max_length=1024, label="Weights path",
                                   widget=forms.TextInput(attrs={"placeholder": "/srv/weights/model.safetensors",
                                                                 "size": 28}))

    path = forms.CharField(required=False, max_length=1024, label="Checkpoint directory",
                           widget=forms.TextInput(attrs={"placeholder": "/srv/models/Qwen3-0.6B", "size": 28}))

    def clean(self):
        data = super().clean()
        if any(name in self.errors for name in ("seed", "weights_path", "path")):
            return data
        given = [name for name in ("seed", "weights_path", "path") if data.get(name) not in (None, "")]
        if not given:
            self.add_error("seed", "give a seed or a weights path (or a checkpoint directory)")
        elif given == ["seed", "weights_path"]:
            self.add_error("weights_path", "give a seed or a weights path, not both")
        elif len(given) > 1:
            self.add_error("path", "give only one of seed, weights path and checkpoint directory")
        return data

    def revision_kwargs(self) -> dict:
        """``label`` plus the one source, as ``revision_create`` / ``model_create`` take them."""
        data = self.cleaned_data
        if data.get("seed") is not None:
            source = {"seed": data["seed"]}
        elif data.get("path"):
            source = {"path": data["path"]}
        else:
            source = {"weights_path": data["weights_path"]}
        return {"label": data["label"], **source}


class ModelCreateForm(RevisionForm):
    """A new deployment and its first revision (which becomes active)."""

    field_order = ["name", "preset", "engine", "label", "seed", "weights_path", "path"]

    name = forms.CharField(max_length=100, validators=[name_validator],
                           widget=forms.TextInput(attrs={"placeholder": "tiny-llama", "size": 18}))
    preset = forms.ChoiceField(required=False)
    engine = forms.ChoiceField(required=False, initial="", choices=[("", "auto"), ("strata", "strata"),
                                                                    ("vllm", "vLLM")])

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from cachecore.model.config import PRESETS  # no torch: config is a plain dataclass module

        self.fields["preset"].choices = [(name, name) for name in sorted(PRESETS)] + [("", "— (checkpoint)")]
        self.fields["label"].label = "First revision"
        self.fields["label"].initial = "r1"
        self.fields["name"].help_text = "what tenants name in requests"
        self.fields["seed"].help_text = "demo weights derived from the seed"
        self.fields["weights_path"].help_text = "or a safetensors file on the workers' disk"
        self.fields["path"].help_text = "or a Hugging Face checkpoint directory (no preset: its config.json)"
        self.fields["engine"].help_text = "auto: vLLM for a checkpoint it serves here, else strata"


class RolloutForm(forms.Form):
    revision = forms.CharField(max_length=64)
    reason = forms.CharField(required=False, max_length=REASON_MAX,
                             widget=forms.TextInput(attrs={"placeholder": "new weights"}))


class RollbackForm(forms.Form):
    """Back to an older revision: said twice (the model's name typed), never the primary button."""

    revision = forms.CharField(max_length=64)
    confirm = forms.CharField(max_length=200, label="Type the model's name to confirm",
                              widget=forms.TextInput(attrs={"autocomplete": "off"}))
    reason = forms.CharField(required=False, max_length=REASON_MAX,
                             widget=forms.TextInput(attrs={"placeholder": "bad weights"}))


class ReplicasForm(forms.Form):
    """Scale a deployment, 0 stopping it (``registry.services.model_set_replicas`` checks the same
    bound); the Stop / Start buttons post 0 / 1 through it."""

    replicas = forms.IntegerField(min_value=0, max_value=MAX_REPLICAS)
    reason = forms.CharField(required=False, max_length=REASON_MAX,
                             widget=forms.TextInput(attrs={"placeholder": "more traffic"}))


class FlushForm(forms.Form):
    """A flush of any scope. Each scope's target fields are required here, with the error next to
    the field (the service checks the same and resolves the names)."""

    NEEDS = {  # scope -> the fields it needs
        FlushJob.Scope.TENANT: ("tenant",),
        FlushJob.Scope.MODEL: ("model",),
        FlushJob.Scope.REVISION: ("model", "revision"),
        FlushJob.Scope.ALL: (),
    }

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
        self.fields["scope"].help_text = "tenant, model, one revision, or all"
        self.fields["reason"].help_text = "recorded in the audit log"
        self.fields["tenant"].help_text = "for scope tenant"
        self.fields["model"].help_text = "for scope model or revision"
        self.fields["revision"].help_text = "for scope revision"

    def clean(self):
        data = super().clean()
        scope = data.get("scope")
        for name in self.NEEDS.get(scope, ()):
            if not data.get(name) and name not in self.errors:
                self.add_error(name, f"scope '{scope}' needs '{name}'")
        return data

    def service_kwargs(self) -> dict:
        """``flush_job_request``'s arguments: the scope, the reason and only the fields it needs."""
        data = self.cleaned_data
        needs = self.NEEDS[data["scope"]]
        return {"scope": data["scope"], "reason": data["reason"],
                **{name: (data[name] or None) if name in needs else None for name in ("tenant", "model", "revision")}}


class OperatorTokenForm(forms.Form):
    """A new operator token; ``nonce`` makes the form single-use (a reload cannot mint a second one)."""

    username = forms.CharField(max_length=150, widget=forms.TextInput(attrs={"placeholder": "ci-bot", "size": 18}))
    role = forms.ChoiceField(choices=OperatorToken.Role.choices, initial=OperatorToken.Role.VIEWER)
    expires_days = forms.IntegerField(min_value=1, max_value=3650, label="Expires in (days)", required=False,
                                      widget=forms.NumberInput(attrs={"size": 6}))
    nonce = forms.CharField(max_length=64, widget=forms.HiddenInput)

    def __init__(self, *args, **kwargs):
        from django.conf import settings

        super().__init__(*args, **kwargs)
        self.fields["username"].help_text = "who or what will use it (audited as this name)"
        self.fields["role"].help_text = "viewer: read only; admin: may change everything"
        self.fields["expires_days"].initial = settings.STRATA_OPERATOR_TOKEN_DAYS
        self.fields["expires_days"].help_text = "it stops working after this (1-3650; empty: the default)"


class ConfirmForm(forms.Form):
    """The second step of a destructive action: the confirmation page posts ``confirm=yes``."""

    NOT_CONFIRMED = "confirm on the confirmation page first"

    confirm = forms.ChoiceField(choices=[("yes", "yes")],
                                error_messages={"required": NOT_CONFIRMED, "invalid_choice": NOT_CONFIRMED})


def form_error_text(form: forms.Form) -> str:
    """All of a form's errors as one line (for a page-level message)."""
    parts = []
    for field, errors in form.errors.items():
        label = "" if field == "__all__" else f"{field}: "
        parts.extend(f"{label}{e}" for e in errors)
    return "; ".join(parts)


CONFIRM_NAME = "Type the model's name to confirm"


class DeleteModelForm(forms.Form):
    """Delete a deployment: said twice (the model's name typed, as a rollback), never the primary button."""

    confirm = forms.CharField(max_length=200, label=CONFIRM_NAME, widget=forms.TextInput(attrs={"autocomplete": "off"}))
    reason = forms.CharField(max_length=REASON_MAX, widget=forms.TextInput(attrs={"placeholder": "no longer served"}))


class DeleteRevisionForm(forms.Form):
    """Delete a revision that is not active: said twice (the model's name typed), as a rollback."""

    revision = forms.CharField(max_length=64)
    confirm = forms.CharField(max_length=200, label=CONFIRM_NAME, widget=forms.TextInput(attrs={"autocomplete": "off"}))
    reason = forms.CharField(max_length=REASON_MAX, widget=forms.TextInput(attrs={"placeholder": "bad weights"}))


def delete_forms(name: str, revisions: list[dict], active: str | None, bound: dict) -> dict:
    """A model row's delete controls: ``delete_form`` always, ``delete_revision_form`` (a choice of
    the revisions that are not active) when there is one; the operator's bound forms when a delete
    was refused (``bound`` keys ``("delete", name)``, ``("delete-revision", name)``)."""
    out: dict = {"delete_form": bound.get(("delete", name)) or DeleteModelForm(auto_id=f"id_del_{name}_%s")}
    inactive = [r for r in revisions if r["label"] != active]
    if inactive:
        form = bound.get(("delete-revision", name)) or DeleteRevisionForm(auto_id=f"id_delrev_{name}_%s")
        form.fields["revision"].widget = forms.Select(
            choices=[(r["label"], f"{r['label']} ({r.get('state', 'staged')})") for r in inactive])
        out["delete_revision_form"] = form
    return out


class DeleteAdapterForm(forms.Form):
    """Delete one of a model's adapters: said twice (the adapter's name typed, as a model's delete)."""

    CONFIRM = "Type the adapter's name to confirm"

    adapter = forms.CharField(max_length=100)
    confirm = forms.CharField(max_length=200, label=CONFIRM, widget=forms.TextInput(attrs={"autocomplete": "off"}))
    reason = forms.CharField(max_length=REASON_MAX, required=False,
                             widget=forms.TextInput(attrs={"placeholder": "retired fine-tune"}))

    def clean(self):
        data = super().clean()
        if data.get("adapter") and data.get("confirm", "").strip() != data["adapter"]:
            self.add_error("confirm", f"type the adapter's name {data['adapter']!r} to confirm")
        return data


def adapter_delete_form(name: str, adapters: list[dict], bound: dict) -> DeleteAdapterForm | None:
    """A model row's adapter delete control (a choice of its live adapters), or None when it has none;
    the operator's bound form when a delete was refused (``bound`` key ``("delete-adapter", name)``)."""
    live = [a for a in adapters if a["state"] == "live"]
    if not live:
        return None
    form = bound.get(("delete-adapter", name)) or DeleteAdapterForm(auto_id=f"id_deladp_{name}_%s")
    form.fields["adapter"].widget = forms.Select(
        choices=[(a["name"], f"{a['name']} ({a['tenant'] or 'public'})") for a in live])
    return form
