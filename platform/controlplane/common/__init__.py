"""Shared helpers: JSON error shape, the acting principal, optional-module hooks, middleware."""
