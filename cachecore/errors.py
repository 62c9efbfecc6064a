"""Typed errors raised by cachecore. Callers (workers, the serving API) map them to HTTP statuses.

Every error carries a stable ``code`` string so the API layer can shape an OpenAI-style error body
without parsing messages.
"""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every error cachecore raises on purpose."""

    code = "cache_error"


class InvalidPrompt(CacheError, ValueError):
    """The prompt is empty, holds non-integer tokens or token ids outside the vocabulary."""

    code = "invalid_prompt"


class PromptTooLong(CacheError, ValueError):
    """Prompt (plus requested generation) exceeds the model's context length."""

    code = "context_length_exceeded"


class UnknownNamespaceField(CacheError, TypeError):
    """A namespace was built with a field name that is not part of the cache-key schema."""

    code = "unknown_namespace_field"


class InvalidNamespace(CacheError, ValueError):
    """A namespace field has the wrong type or value (e.g. a scope salt that is not 32 bytes)."""

    code = "invalid_namespace"


class OutOfBlocks(CacheError, RuntimeError):
    """Not enough free blocks to admit the request right now (all others are held by running requests)."""

    code = "out_of_blocks"


class InflightLimit(CacheError, RuntimeError):
    """The tenant already holds its in-flight share of the pool in running requests; retry later.
    Says nothing about other tenants or the pool's size."""

    code = "inflight_limit"


class TenantBusy(CacheError, RuntimeError):
    """The tenant already runs its limit of concurrent requests on this worker; retry later."""

    code = "tenant_busy"


class Cancelled(CacheError, RuntimeError):
    """The client went away; the request was stopped and its blocks released."""

    code = "cancelled"


class RequestStopped(CacheError, RuntimeError):
    """The platform stopped the request while its client waited (its tenant was suspended or
    offboarded, or the data key it ran under was shredded); its blocks were released. Retryable: a
    new request gets the tenant's current answer (served under the new key, or refused)."""

    code = "request_stopped"


class InvalidKV(CacheError, ValueError):
    """KV bytes handed to ``store`` do not match the layout (shape, dtype or block count)."""

    code = "invalid_kv"


class KVApiUnsupported(CacheError):
    """A replica that has no KV to serve through the KV API (a vLLM deployment without Strata's tiers).
    Defined here, with the other errors a replica raises to the web tier, so the web process unpickles
    it without importing the replica's engine."""

    code = "kv_api_unsupported"


class AdapterUnsupported(CacheError):
    """A request for a LoRA adapter on a replica that cannot serve one (the reference engine, or a vLLM
    engine started without LoRA), or whose adapter files changed since it was registered."""

    code = "adapter_unsupported"


class DecryptError(CacheError, ValueError):
    """An L3 object (or a wrapped data key) failed to decrypt or verify: wrong key, wrong associated
    data (moved to another key, tenant, model or revision), torn, truncated, bit-flipped or of an
    unknown format version. The message never holds key material or plaintext."""

    code = "corrupt_object"


class KeyUnavailable(DecryptError):
    """The data-key version an L3 object was sealed with is not held (shredded, or not yet
    delivered to this worker): the object cannot be read, but it is not corrupt."""

    code = "key_unavailable"


class BackendUnavailable(CacheError, OSError):
    """The L3 backend (filesystem directory, Redis) is down, unreachable, unreadable or too slow
    (a socket timeout). The only error a backend raises for the state of the backend."""

    code = "l3_unavailable"
