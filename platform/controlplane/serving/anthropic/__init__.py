"""Anthropic's Messages API (``POST /v1/messages``) on the chat completions path: the same gate, quotas,
ledger, audit and diagnostics, with ``cache_control`` breakpoints soft-pinned as named caches."""
