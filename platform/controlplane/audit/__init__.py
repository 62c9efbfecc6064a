"""Append-only, hash-chained audit log (docs/design.md section 4)."""
