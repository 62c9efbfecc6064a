"""Routes of the serving API, mounted at ``/v1/``."""

from django.urls import path

from controlplane.caches import api as cache_api
from controlplane.serving import views
from controlplane.serving.anthropic import views as anthropic_views
from controlplane.serving.openai_responses.urls import urlpatterns as responses_urls

urlpatterns = [
    path("models", views.models),
    path("completions", views.completions),
    path("chat/completions", views.chat_completions),
    path("messages", anthropic_views.messages),
    *responses_urls,
    path("kv/layout", views.kv_layout),
    path("kv/lookup", views.kv_lookup),
    path("kv/store", views.kv_store),
    path("kv/retrieve", views.kv_retrieve),
    path("caches", cache_api.caches),
    path("caches/<str:cache_id>", cache_api.cache_detail),
]
