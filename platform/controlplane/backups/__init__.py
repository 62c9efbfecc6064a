"""Backups and restores of one Strata installation (``manage.py strata_backup`` / ``strata_restore``).

One archive (an uncompressed tar, mode 0600) holds everything a restore needs: the database
(``pg_dump``'s custom format for PostgreSQL, a SQLite copy made with SQLite's backup API), the key
files (master key, audit key, Django's secret key; tenants' data keys stay wrapped inside the
database), the audit chain's external head log and the objects of a ``file://`` L3. Its last member,
``manifest.json``, names versions, migration heads, the audit head and a SHA-256 per member.

One module per concern: ``manifest`` (member names, the manifest, migration heads), ``archive``
(exclusive writing, verified reading), ``database`` (dump and restore per vendor), ``keys`` (where
each key lives, fingerprints, installing), ``l3`` (the L3 store's objects), ``services`` (the two
procedures, audited).
"""
