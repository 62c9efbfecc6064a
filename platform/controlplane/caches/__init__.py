"""Named caches: prefixes a tenant prewarms, soft-pins, extends and deletes (``POST /v1/caches``)."""
