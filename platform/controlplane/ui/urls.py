"""Operator UI routes under /ui/ (included at the site root by ``controlplane.urls``)."""

from django.urls import path

from controlplane.ui import (
    chart_views,
    delete_views,
    model_views,
    tenant_flush_views,
    tenant_views,
    token_views,
    user_views,
    views,
)

app_name = "ui"

urlpatterns = [
    path("ui/", views.dashboard, name="dashboard"),
    path("ui/live/", views.dashboard_live, name="dashboard-live"),
    path("ui/charts/cluster.json", chart_views.cluster_charts, name="charts-cluster"),
    path("ui/charts/tenants/<slug:slug>.json", chart_views.tenant_charts, name="charts-tenant"),
    path("ui/login/", views.LoginView.as_view(), name="login"),
    path("ui/logout/", views.LogoutView.as_view(), name="logout"),
    path("ui/tenants/", tenant_views.tenants, name="tenants"),
    path("ui/tenants/<slug:slug>/", tenant_views.tenant_detail, name="tenant"),
    path("ui/tenants/<slug:slug>/status/", tenant_views.tenant_status, name="tenant-status"),
    path("ui/tenants/<slug:slug>/settings/", tenant_views.tenant_settings, name="tenant-settings"),
    path("ui/tenants/<slug:slug>/keys/", tenant_views.key_create, name="tenant-key-create"),
    path("ui/tenants/<slug:slug>/keys/<int:key_id>/revoke/", tenant_views.key_revoke, name="tenant-key-revoke"),
    path("ui/tenants/<slug:slug>/grants/", tenant_views.grant_add, name="tenant-grant-add"),
    path("ui/tenants/<slug:slug>/grants/<str:model>/remove/", tenant_views.grant_remove, name="tenant-grant-remove"),
    path("ui/tenants/<slug:slug>/share-group/join/", tenant_views.share_group_join, name="tenant-group-join"),
    path("ui/tenants/<slug:slug>/share-group/new/", tenant_views.share_group_new, name="tenant-group-new"),
    path("ui/tenants/<slug:slug>/share-group/leave/", tenant_views.share_group_leave, name="tenant-group-leave"),
    path("ui/tenants/<slug:slug>/data-keys/rotate/", tenant_views.data_key_rotate, name="tenant-data-key-rotate"),
    path("ui/tenants/<slug:slug>/data-keys/<int:version>/shred/", tenant_views.data_key_shred,
         name="tenant-data-key-shred"),
    path("ui/tenants/<slug:slug>/caches/<str:cache_id>/delete/", tenant_views.named_cache_delete,
         name="tenant-cache-delete"),
    path("ui/tenants/<slug:slug>/offboard/", tenant_views.tenant_offboard, name="tenant-offboard"),
    path("ui/tenants/<slug:slug>/flush/", tenant_flush_views.tenant_flush, name="tenant-flush"),
    path("ui/models/", model_views.models, name="models"),
    path("ui/models/<str:name>/revisions/", model_views.revision_add, name="revision-add"),
    path("ui/models/<str:name>/rollout/", model_views.rollout, name="rollout"),
    path("ui/models/<str:name>/rollback/", model_views.rollback, name="rollback"),
    path("ui/models/<str:name>/delete/", delete_views.model_delete, name="model-delete"),
    path("ui/models/<str:name>/revisions/delete/", delete_views.revision_delete, name="revision-delete"),
    path("ui/models/<str:name>/replicas/", model_views.replicas, name="replicas"),
    path("ui/jobs/", model_views.jobs, name="jobs"),
    path("ui/jobs/live/", model_views.jobs_live, name="jobs-live"),
    path("ui/jobs/<int:job_id>/", model_views.job_detail, name="job"),
    path("ui/jobs/<int:job_id>/live/", model_views.job_live, name="job-live"),
    path("ui/tokens/", token_views.tokens, name="tokens"),
    path("ui/users/", user_views.users, name="users"),
    path("ui/users/<int:user_id>/", user_views.user_change, name="user-change"),
    path("ui/tokens/<int:token_id>/revoke/", token_views.token_revoke, name="token-revoke"),
    path("ui/audit/", views.audit, name="audit"),
]
