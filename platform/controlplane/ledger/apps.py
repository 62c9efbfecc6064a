from django.apps import AppConfig


class LedgerConfig(AppConfig):
    name = "controlplane.ledger"
    label = "ledger"
    verbose_name = "Tenant cache ledger"
    default_auto_field = "django.db.models.BigAutoField"
