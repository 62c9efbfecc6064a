from django.apps import AppConfig


class OperatorsConfig(AppConfig):
    name = "controlplane.operators"
    label = "operators"

    def ready(self) -> None:
        from django.contrib.auth import get_user_model
        from django.db.models.signals import post_save, pre_save

        from controlplane.operators import signals

        user = get_user_model()
        pre_save.connect(signals.remember_flags, sender=user, dispatch_uid="strata-user-flags-pre")
        post_save.connect(signals.audit_flag_change, sender=user, dispatch_uid="strata-user-flags-post")
