"""Model deployments and their weight revisions (the revision digest is part of every cache key)."""
