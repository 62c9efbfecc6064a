"""Real state for the backup tests, built and checked inside ``manage.py shell`` subprocesses.

:func:`seed` runs in the installation that is backed up: two tenants through the services (each
write audited), a live and a revoked API key, and two L3 objects written by the real L3 code
(``RemoteStore`` on the installation's ``STRATA_L3_URL``), sealed with the tenant's data keys as a
worker unwraps them with the master key: one under version 1, one under version 2 after a rotation.
:func:`probe` runs in the installation restored from the backup and reads everything back through
the same code paths. Both write JSON for the test to compare.
"""

from __future__ import annotations

import hashlib
import json

CB = 4  # blocks per L3 chunk: one object per request below
MODEL, REVISION = "m1", "r1"


def _layout():
    from cachecore.layout import KVLayout

    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16)


def _request(seed: int):
    """(namespace digest, tokens, chain hashes, kv) of one deterministic chunk-sized request."""
    import torch

    from cachecore.hashing import chain_hashes
    from cachecore.namespace import Namespace

    layout = _layout()
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(70_000, 2**31, (CB * layout.block_size,), generator=g).tolist()
    ns = Namespace.build(scope_salt=bytes([seed]) * 32, model_id=MODEL, weight_digest="w", tokenizer_digest="t",
                         layout=layout.canonical(), rope={"theta": 10000})
    kv = torch.randn((CB, *layout.page_shape), generator=g).to(layout.torch_dtype)
    return ns.digest, tokens, chain_hashes(ns, tokens, layout.block_size), kv


def _digest(kv) -> str:
    import torch

    return hashlib.sha256(kv.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _store(tenant):
    """The tenant's keyring (every readable data-key version, unwrapped with this installation's
    master key, as a worker does) and a RemoteStore on this installation's L3 URL."""
    import strata_env
    from cachecore.crypto import Keyring, unwrap_key
    from cachecore.tiers.backends import open_backend
    from cachecore.tiers.remote import RemoteStore
    from controlplane.common.masterkey import master_key
    from controlplane.tenants.selectors import data_key_for_worker

    keyring = Keyring()
    for entry in data_key_for_worker(tenant)["readable"]:
        keyring.add(str(tenant.pk), entry["version"],
                    unwrap_key(master_key(), entry["wrapped"], tenant=str(tenant.pk), version=entry["version"]))
    return RemoteStore(open_backend(strata_env.load_worker().l3_url), keyring, _layout(), chunk_blocks=CB)


def _tag(tenant, ns_digest: bytes):
    from cachecore.tiers.base import Tag

    return Tag(str(tenant.pk), MODEL, REVISION, ns_digest, True)


def seed(out: str) -> None:
    from controlplane.audit.selectors import audit_verify
    from controlplane.common.actor import Actor
    from controlplane.common.masterkey import fingerprint, master_key
    from controlplane.tenants.datakeys import data_key_rotate
    from controlplane.tenants.services import api_key_create, api_key_revoke, tenant_create

    actor = Actor.system("backup-test")
    acme = tenant_create(actor=actor, slug="acme", name="Acme Corp")
    tenant_create(actor=actor, slug="globex", name="Globex")
    _, live = api_key_create(actor=actor, tenant=acme, name="live")
    old, revoked = api_key_create(actor=actor, tenant=acme, name="old")
    api_key_revoke(actor=actor, api_key=old, reason="rotated")
    objects = []
    for seed_ in (1, 2):
        if seed_ == 2:
            data_key_rotate(actor=actor, tenant=acme, reason="second object under a new version")
        store = _store(acme)
        ns_digest, tokens, hashes, kv = _request(seed_)
        assert store.put_chunk(hashes, tokens, _tag(acme, ns_digest), kv), "the L3 object was not written"
        objects.append({"seed": seed_, "version": store.keyring.active(str(acme.pk))[0], "sha256": _digest(kv)})
    verify = audit_verify()
    assert verify["ok"], verify
    with open(out, "w") as fh:
        json.dump({"tenant": "acme", "live_key": live, "revoked_key": revoked, "objects": objects,
                   "audit_length": verify["length"], "master_fingerprint": fingerprint(master_key())}, fh)


def probe(seeded: str, out: str) -> None:
    from django.test import Client

    from cachecore.crypto import DecryptError, generate_key, unwrap_key
    from controlplane.audit.models import AuditEvent
    from controlplane.audit.selectors import audit_verify
    from controlplane.common.masterkey import fingerprint, master_key
    from controlplane.tenants.models import Tenant
    from controlplane.tenants.selectors import data_key_for_worker

    with open(seeded) as fh:
        state = json.load(fh)
    acme = Tenant.objects.get(slug=state["tenant"])
    restored = audit_verify()  # before anything here appends (a refused key is audited)
    actions = list(AuditEvent.objects.order_by("seq").values_list("action", flat=True))
    client = Client(HTTP_HOST="localhost")
    status = {name: client.get("/v1/models", headers={"Authorization": f"Bearer {state[name]}"}).status_code
              for name in ("live_key", "revoked_key")}
    store = _store(acme)
    objects = []
    for entry in state["objects"]:
        ns_digest, tokens, hashes, _ = _request(entry["seed"])
        fetched = store.get(hashes, tokens, _tag(acme, ns_digest), CB)
        objects.append({"seed": entry["seed"], "stopped": fetched.stopped, "blocks": int(fetched.kv.shape[0]),
                        "sha256": _digest(fetched.kv) if fetched.kv.shape[0] else None})
    wrapped = data_key_for_worker(acme)["readable"][0]
    try:  # the paired negative: another master key does not open the restored data keys
        unwrap_key(generate_key(), wrapped["wrapped"], tenant=str(acme.pk), version=wrapped["version"])
        other_key_opens = True
    except DecryptError:
        other_key_opens = False
    with open(out, "w") as fh:
        json.dump({"verify": restored, "actions": actions, "verify_after": audit_verify(), "auth": status,
                   "objects": objects, "other_key_opens": other_key_opens,
                   "master_fingerprint": fingerprint(master_key())}, fh)
