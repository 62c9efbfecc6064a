"""Operator UI routes under /ui/ (included at the site root by ``controlplane.urls``)."""

from django.urls import path

from controlplane.ui import views

app_name = "ui"

urlpatterns = [
    path("ui/", views.dashboard, name="dashboard"),
    path("ui/live/", views.dashboard_live, name="dashboard-live"),
    path("ui/login/", views.LoginView.as_view(), name="login"),
    path("ui/logout/", views.LogoutView.as_view(), name="logout"),
    path("ui/tenants/", views.tenants, name="tenants"),
    path("ui/tenants/<slug:slug>/status/", views.tenant_status, name="tenant-status"),
    path("ui/models/", views.models, name="models"),
    path("ui/models/<str:name>/revisions/", views.revision_add, name="revision-add"),
    path("ui/models/<str:name>/rollout/", views.rollout, name="rollout"),
    path("ui/jobs/", views.jobs, name="jobs"),
    path("ui/jobs/live/", views.jobs_live, name="jobs-live"),
    path("ui/jobs/<int:job_id>/", views.job_detail, name="job"),
    path("ui/jobs/<int:job_id>/live/", views.job_live, name="job-live"),
    path("ui/audit/", views.audit, name="audit"),
]
