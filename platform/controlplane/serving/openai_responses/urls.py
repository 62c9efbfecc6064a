"""Routes of the Responses API (``/v1/responses``), spread into ``serving.urls``."""

from django.urls import path

from controlplane.serving.openai_responses import views

urlpatterns = [
    path("responses", views.create),
    path("responses/<str:response_id>", views.detail),
    path("responses/<str:response_id>/input_items", views.input_items),
]
