"""Admin API (django-ninja) at /api/admin/: thin routers over services and selectors."""
