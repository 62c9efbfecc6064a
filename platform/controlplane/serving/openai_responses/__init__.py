"""OpenAI's Responses API (``/v1/responses``) on the chat completions path: same admission, quotas,
worker request, accounting; conversations kept by ``controlplane.conversations``."""
