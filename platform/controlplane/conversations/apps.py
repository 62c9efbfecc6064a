from django.apps import AppConfig


class ConversationsConfig(AppConfig):
    name = "controlplane.conversations"
    label = "conversations"
    verbose_name = "Stored responses"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from controlplane.timeseries.apps import sampler_enabled

        if sampler_enabled():  # the process that runs the periodic duties (conversations.sweeper)
            from controlplane.conversations import sweeper

            sweeper.start()
