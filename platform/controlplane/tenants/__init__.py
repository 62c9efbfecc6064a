"""Tenants, their API keys, grants (ACL to model deployments) and share groups."""
