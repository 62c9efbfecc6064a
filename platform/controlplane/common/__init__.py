"""Shared helpers: JSON error shape, the acting principal, middleware."""
