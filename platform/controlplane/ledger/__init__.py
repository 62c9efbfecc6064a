"""The tenant cache ledger: billing-grade hourly accounting of what each tenant's requests presented
to the cache, read from it (per tier), wrote to it and lost (per miss reason), and what it stored
(pinned named-cache token-seconds, L3 byte-seconds). See ``models`` for the figures' meaning."""
