"""Stored responses of OpenAI's Responses API: a tenant's conversations, sealed under its data key."""
