"""Tenant LoRA adapters on a shared base deployment: the registry (models, services, selectors)."""
