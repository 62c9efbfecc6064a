"""Weight digests computed in the background: a revision whose weights are too big to hash on the
request is recorded with its digest pending and hashed here, crash-safe (a lease renewed by a heartbeat)."""
