"""Operator bearer tokens (roles admin / viewer) for the admin API."""
