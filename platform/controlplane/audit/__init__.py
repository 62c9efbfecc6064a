"""Append-only, hash-chained audit log (DESIGN section 4)."""
