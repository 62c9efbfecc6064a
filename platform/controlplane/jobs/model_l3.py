"""A deployment's L3 objects, seen and deleted from the control plane, so that they leave even where no
replica runs to delete them (a stopped deployment, replicas already gone, objects a replica wrote
after its flush).

The store is the one the workers use: ``STRATA_L3_URL`` read as they read it (``strata_env``), opened
by cachecore's own backends; objects are picked by name (``<tenant>/<model>/<revision>/v<n>/<hash>``,
``cachecore.tiers.remote.names``), every tenant's. A ``file://`` store's directories of the scope are
then removed whole, with what a killed writer left there (temporary files no listing returns), and
the bytes under them are counted from the disk itself: what a delete job verifies is 0.

Importing the names loads cachecore's L3 package (and torch): only the Celery process that runs a
delete job does, when it runs one; the web process never imports this module.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, NamedTuple

import strata_env


class Usage(NamedTuple):
    objects: int
    bytes: int


def open_store() -> Any:
    """The workers' L3 backend, or None where L3 is off (``none``). Raises ``BackendUnavailable`` or
    ``ValueError`` for a store that cannot be opened."""
    from cachecore.tiers.backends import open_backend

    return open_backend(strata_env.load_worker().l3_url.strip())


def _match(model: str, revision: str | None):
    """Objects of ``model`` (of its ``revision`` and the revision's variants ``<revision>~...``: its
    LoRA adapters' KV, which goes with it)."""
    from cachecore.tiers.remote.names import scope_matcher

    return scope_matcher(None, model, revision, None, revision_variants=revision is not None)


def _scope_dirs(backend: Any, model: str, revision: str | None) -> list[str]:
    """A file store's directories of the scope, one under each tenant's (none for other stores)."""
    from cachecore.tiers.remote.names import enc

    root = getattr(backend, "root", None)
    if root is None or not os.path.isdir(root):
        return []
    from cachecore.tiers.remote.names import VARIANT

    with os.scandir(root) as tenants:
        models = [os.path.join(t.path, enc(model)) for t in tenants if t.is_dir(follow_symlinks=False)]
    models = [d for d in models if os.path.isdir(d)]
    if revision is None:
        return models
    own, variants = enc(revision), enc(revision + VARIANT)  # the revision's and its variants' (adapters')
    out = []
    for directory in models:
        with os.scandir(directory) as revisions:
            out += [r.path for r in revisions if r.is_dir(follow_symlinks=False)
                    and (r.name == own or r.name.startswith(variants))]
    return out


def count(backend: Any, *, model: str, revision: str | None = None) -> Usage:
    """Objects of ``model`` (of its ``revision`` when given) the store lists, and their bytes."""
    if backend is None:
        return Usage(0, 0)
    match = _match(model, revision)
    objects = size = 0
    for info in backend.list(""):
        if match(info.name):
            objects += 1
            size += info.size
    return Usage(objects, size)


def on_disk(backend: Any, *, model: str, revision: str | None = None) -> Usage:
    """Files (temporary ones included) and bytes under a file store's directories of the scope."""
    files = size = 0
    for directory in _scope_dirs(backend, model, revision):
        for base, _, names in os.walk(directory):
            for name in names:
                try:
                    size += os.lstat(os.path.join(base, name)).st_size
                    files += 1
                except FileNotFoundError:
                    pass
    return Usage(files, size)


def purge(*, model: str, revision: str | None = None) -> dict:
    """Delete every L3 object of ``model`` (of its ``revision``), then a file store's directories of
    it, and count again. Returns the objects and their ``bytes`` deleted, the ``disk_bytes`` the scope
    held on a file store's disk before (temporary files included), and what is ``left_objects`` and
    ``left_disk_bytes`` after (0 and 0: verified). Idempotent. Raises ``BackendUnavailable``."""
    backend = open_store()
    if backend is None:
        return {"store": "none", "objects": 0, "bytes": 0, "disk_bytes": 0, "left_objects": 0, "left_disk_bytes": 0}
    disk = on_disk(backend, model=model, revision=revision)
    match = _match(model, revision)
    objects = size = 0
    for info in list(backend.list("")):
        if match(info.name) and backend.delete(info.name):
            objects += 1
            size += info.size
    for directory in _scope_dirs(backend, model, revision):
        shutil.rmtree(directory, ignore_errors=True)  # what killed writers left: no listing returns it
    left = count(backend, model=model, revision=revision)
    return {"store": type(backend).__name__, "objects": objects, "bytes": size, "disk_bytes": disk.bytes,
            "left_objects": left.objects, "left_disk_bytes": on_disk(backend, model=model, revision=revision).bytes}
