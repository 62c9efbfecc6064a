"""An adapter's KV is its own in every key and tag, without a replica: the namespace's ``lora_id`` in
the hashes the worker and the router compute, and the ``<revision>~<adapter>`` tag its L2 blocks and
L3 objects carry, which an adapter flush selects alone and a revision flush (a rollout) selects with
the revision's own."""

from __future__ import annotations

from cachecore.hashing import chain_hashes
from cachecore.namespace import Namespace
from cachecore.routing.hashes import namespace_fields, request_hashes
from cachecore.tiers.backends import open_backend
from cachecore.tiers.base import Tag
from tests.test_l3 import CB, _keyring, _request, _store, _tag
from workers.kv_tiers import _matcher
from workers.protocol import WorkerRequest
from workers.vllm_worker import label_of, lora_id, tag_revision

SALT = b"\x07" * 32
LORA_A = {"name": "a", "id": 1, "digest": "aa" * 32, "path": "/x/a", "scope": "lora1-aaaaaaaaaaaaaaaa"}
LORA_B = {"name": "b", "id": 2, "digest": "bb" * 32, "path": "/x/b", "scope": "lora2-bbbbbbbbbbbbbbbb"}


def _ns(lora: str = "") -> Namespace:
    return Namespace.build(scope_salt=SALT, model_id="m", weight_digest="w", tokenizer_digest="t",
                           layout={"block_size": 16}, rope={}, lora_id=lora)


def test_the_same_prompt_has_other_keys_on_each_adapter_and_the_router_computes_the_worker_s():
    tokens = list(range(64))
    keys = {lora: chain_hashes(_ns(lora), tokens, 16) for lora in ("", LORA_A["scope"], LORA_B["scope"])}
    assert len({k[0] for k in keys.values()}) == 3  # base, A and B share not even the first block
    assert chain_hashes(_ns(LORA_A["scope"]), tokens, 16) == keys[LORA_A["scope"]]  # and each is stable
    fields = namespace_fields(_ns(), 16)  # what a replica publishes: the base model's (lora_id "")
    assert request_hashes(fields, SALT, tokens) == keys[""]
    assert request_hashes({**fields, "lora_id": LORA_A["scope"]}, SALT, tokens) == keys[LORA_A["scope"]]


def test_worker_requests_carry_the_adapter_s_scope_into_key_and_tag():
    base = WorkerRequest(tenant="1", scope_salt=SALT, prompt=[1, 2])
    on_a = base.with_(lora=LORA_A)
    assert WorkerRequest.from_dict(on_a.to_dict()).lora == LORA_A
    assert (lora_id(base), lora_id(on_a)) == ("", LORA_A["scope"])
    assert (tag_revision("r1", base), tag_revision("r1", on_a)) == ("r1", "r1~" + LORA_A["scope"])
    assert label_of(tag_revision("r1", on_a)) == "r1"


def test_an_adapter_flush_selects_its_l2_blocks_alone_and_a_revision_flush_its_variants_too():
    tags = {name: Tag("t", "m", rev, b"\0" * 32, True)
            for name, rev in (("base", "r1"), ("a", "r1~" + LORA_A["scope"]), ("b", "r1~" + LORA_B["scope"]),
                              ("r2", "r2"), ("r10", "r10"))}
    by_adapter = _matcher({"scope": "adapter", "adapter": LORA_A["scope"]})
    assert {n for n, t in tags.items() if by_adapter(t)} == {"a"}
    by_revision = _matcher({"scope": "revision", "revision": "r1"})
    assert {n for n, t in tags.items() if by_revision(t)} == {"base", "a", "b"}


def test_l3_deletes_an_adapter_s_objects_alone_and_a_rollout_the_revision_s_with_its_adapters(tmp_path):
    store = _store(open_backend(f"file://{tmp_path / 'l3'}"), _keyring("t1", "t2"))
    ns, tokens, hashes, kv = _request(5, CB)
    a, b = "r1~" + LORA_A["scope"], "r1~" + LORA_B["scope"]
    for owner, rev in (("t1", "r1"), ("t1", a), ("t2", a), ("t1", b), ("t1", "r2"), ("t1", "r10")):
        assert store.put_chunk(hashes, tokens, _tag(ns, owner, "m1", rev), kv)
    assert store.count_scope(model="m1", revision=a)[0] == 2  # every tenant's objects of adapter A
    assert store.count_scope(model="m1", revision="r1")[0] == 1
    assert store.count_scope(model="m1", revision="r1", revision_variants=True)[0] == 4
    assert store.delete_scope(model="m1", revision=a)[0] == 2
    assert store.count_scope(model="m1", revision=b)[0] == 1  # B untouched
    assert store.delete_scope(tenant="t1", model="m1", revision="r1", revision_variants=True)[0] == 2
    assert store.count_scope()[0] == 2 and store.count_scope(model="m1", revision="r2")[0] == 1  # r2, r10 stay
    store.check_integrity()
