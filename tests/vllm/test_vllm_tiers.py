"""Strata's tiers under vLLM (``workers.kv_connector``): a prefix vLLM lost comes back from Strata's L2
or encrypted L3 into vLLM's pages with identical greedy output; keys come from the server only; a
corrupt or missing block is recomputed; flushes, shreds and rollouts hold."""

from __future__ import annotations

import base64
import os
import secrets

import pytest
import torch

from tests.l3_workers import DAY, L3Site
from tests.worker_calls import complete
from workers.config import WorkerConfig
from workers.kv_params import TransferParams

BS = 32


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    s = L3Site(tmp_path_factory.mktemp("vllm-l3"))
    # vLLM's processes inherit the session's STRATA_MASTER_KEY, which wins over a key file
    s.master = base64.b64decode(os.environ["STRATA_MASTER_KEY"])
    return s


def _worker(site: L3Site, path, *, l2_mb: int = 64, label: str = "r1", **cfg):
    from workers.vllm_worker import VllmWorker

    config = WorkerConfig(l1_mb=16, l2_mb=l2_mb, l3_url=site.l3.as_uri(), master_key_file=str(site.key_file),
                          load_policy="always_load", **cfg)
    return VllmWorker(deployment="vllm-tiers", preset="", config=config,
                      revision={"label": label, "checkpoint_path": str(path)})


@pytest.fixture(scope="module")
def tiered(site, vllm_checkpoint):
    worker = _worker(site, vllm_checkpoint[0])
    yield worker
    worker.close()


def _run(worker, site: L3Site, tenant: str, salt: bytes, prompt: list[int], *, max_tokens: int = 8, **kw) -> dict:
    req = {**site.request(tenant, prompt, scope_salt=salt, **kw), "max_tokens": max_tokens}
    out = complete(worker, req)
    assert "error" not in out, out
    worker.drain_writes()
    return out


def _reset_vllm(worker) -> None:
    """vLLM forgets every prefix it holds (as if other tenants' traffic had evicted them)."""
    assert worker.loop.run(worker._reset(worker._active), timeout=60)


@pytest.mark.parametrize("length", [33, 63, 64, 65, 300])
def test_evicted_prefix_comes_back_from_l2_with_identical_output(tiered, site, length):
    salt = secrets.token_bytes(32)
    prompt = _prompt(length, length)
    cold = _run(tiered, site, "t1", salt, prompt)
    assert cold["usage"]["cached_tokens"] == 0
    _reset_vllm(tiered)
    before = tiered.stats()["tiers"]["l2"]["hit_tokens"]
    warm = _run(tiered, site, "t1", salt, prompt)
    assert warm["usage"]["cached_tokens"] == (length - 1) // BS * BS
    assert warm["token_ids"] == cold["token_ids"]
    assert tiered.stats()["tiers"]["l2"]["hit_tokens"] - before == (length - 1) // BS * BS


def test_another_scope_never_loads_the_blocks(tiered, site):
    prompt = _prompt(200, 7)
    _run(tiered, site, "t1", secrets.token_bytes(32), prompt)
    _reset_vllm(tiered)
    assert _run(tiered, site, "t2", secrets.token_bytes(32), prompt)["usage"]["cached_tokens"] == 0


def test_multi_turn_chat_is_exact_from_l2(tiered, site):
    salt = secrets.token_bytes(32)
    turn1 = _prompt(90, 11)
    out1 = _run(tiered, site, "t1", salt, turn1)
    turn2 = turn1 + out1["token_ids"] + _prompt(40, 12)
    cold2 = _run(tiered, site, "t1", secrets.token_bytes(32), turn2, max_tokens=6)  # another scope: cold
    _reset_vllm(tiered)
    warm2 = _run(tiered, site, "t1", salt, turn2, max_tokens=6)
    assert warm2["usage"]["cached_tokens"] >= 64  # turn 1's prompt blocks, from L2
    assert warm2["token_ids"] == cold2["token_ids"]


def test_a_fresh_engine_loads_from_l3_with_identical_output(site, vllm_checkpoint, tiered):
    salt = secrets.token_bytes(32)
    prompt = _prompt(600, 21)  # two L3 chunks of 256 tokens
    cold = _run(tiered, site, "t3", salt, prompt)
    assert site.files("t3"), "nothing was written to L3"
    fresh = _worker(site, vllm_checkpoint[0], l2_mb=0)  # a restart: empty vLLM cache, no L2
    try:
        warm = _run(fresh, site, "t3", salt, prompt)
        assert warm["usage"]["cached_tokens"] == 512
        assert warm["token_ids"] == cold["token_ids"]
        assert fresh.stats()["tiers"]["l3"]["hit_tokens"] == 512
        # persist=False neither reads nor writes L3
        _reset_vllm(fresh)
        assert _run(fresh, site, "t3", salt, prompt, persist=False)["usage"]["cached_tokens"] == 0
        # a corrupt object is a miss (recomputed, identical output) and is quarantined
        for f in site.files("t3"):
            data = bytearray(f.read_bytes())
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        _reset_vllm(fresh)
        again = _run(fresh, site, "t3", salt, prompt)
        assert again["usage"]["cached_tokens"] == 0
        assert again["token_ids"] == cold["token_ids"]
        assert fresh.stats()["tiers"]["l3"]["corrupt_loads"] >= 1
    finally:
        fresh.close()


def test_tenant_flush_deletes_l2_and_l3_and_spares_others(tiered, site):
    salt_a, salt_b = secrets.token_bytes(32), secrets.token_bytes(32)
    prompt = _prompt(300, 31)
    _run(tiered, site, "fa", salt_a, prompt)
    _run(tiered, site, "fb", salt_b, prompt)
    assert site.files("fa") and site.files("fb")
    result = tiered.flush({"scope": "tenant", "tenant": "fa"})
    assert result["tiers"]["l2"] >= 9 and result["tiers"]["l3"] >= 1
    assert tiered.probe({"scope": "tenant", "tenant": "fa"}) == {"remaining_blocks": 0, "ok": True}
    assert not site.files("fa") and site.files("fb")
    _reset_vllm(tiered)
    assert _run(tiered, site, "fa", salt_a, prompt)["usage"]["cached_tokens"] == 0
    assert _run(tiered, site, "fb", salt_b, prompt)["usage"]["cached_tokens"] == 288


def test_shredded_key_version_is_deleted_and_never_read(tiered, site):
    salt = secrets.token_bytes(32)
    prompt = _prompt(300, 41)
    _run(tiered, site, "sh", salt, prompt)
    assert site.files("sh")
    assert tiered.drop_data_key({"tenant": "sh", "version": 1})["objects"] >= 1
    assert not site.files("sh")


def test_kv_transfer_params_must_be_exactly_strata_s():
    p = TransferParams(tenant="1", model="m", revision="r", ns_digest=b"x" * 32, hashes=(b"h" * 32,))
    assert TransferParams.from_wire(p.to_wire()) == p
    assert TransferParams.from_wire({"strata": {**p.to_wire()["strata"], "extra": 1}}) is None
    assert TransferParams.from_wire({"strata": p.to_wire()["strata"], "do_remote_prefill": True}) is None
    assert TransferParams.from_wire({"strata": {**p.to_wire()["strata"], "hashes": ["ab"]}}) is None
    assert TransferParams.from_wire(None) is None


def test_tenant_fair_share_in_l2_survives_a_flood(site, vllm_checkpoint):
    """Tenant A floods a small L2 after B cached its prefix: B's blocks stay (its fair share)."""
    worker = _worker(site, vllm_checkpoint[0], l2_mb=2)  # 2 MiB: 64 blocks of 32 tokens here
    try:
        salt_b = secrets.token_bytes(32)
        hot = _prompt(300, 51)
        _run(worker, site, "b", salt_b, hot, persist=False, retention=DAY)
        salt_a = secrets.token_bytes(32)
        for i in range(12):
            _run(worker, site, "a", salt_a, _prompt(400, 100 + i), persist=False, max_tokens=1)
        stats = worker.stats()
        assert stats["tiers"]["l2"]["evictions"] > 0
        _reset_vllm(worker)
        assert _run(worker, site, "b", salt_b, hot, persist=False)["usage"]["cached_tokens"] == 288
        assert worker.check_integrity()
    finally:
        worker.close()


def _kv_req(tenant: str, scope: bytes, tokens: list[int], own: bytes | None = None) -> dict:
    return {"tenant": tenant, "scope_salt": scope, "tenant_salt": own or scope, "tokens": tokens}


def test_kv_api_retrieves_the_model_kv_vllm_computed_in_the_canonical_layout(tiered, site, vllm_checkpoint):
    hf = vllm_checkpoint[1]
    salt = secrets.token_bytes(32)
    prompt = _prompt(100, 61)
    _run(tiered, site, "kv", salt, prompt)
    layout = tiered.kv_layout()
    assert layout["page_shape"] == [2, 2, BS, 1, 64] and layout["pages"] == "canonical"
    assert tiered.kv_lookup(_kv_req("kv", salt, prompt)) == {"hit_tokens": 96, "origin": "model"}
    kv, mask, origin = tiered.kv_retrieve(_kv_req("kv", salt, prompt))
    assert origin == "model" and tuple(kv.shape) == (3, 2, 2, BS, 1, 64) and int(mask.sum()) == 96
    with torch.no_grad():  # the reference: transformers' own K and V for the same tokens
        past = hf(torch.tensor([prompt[:96]]), use_cache=True).past_key_values
    for layer in range(2):
        k_ref, v_ref = (t[0] for t in (past.layers[layer].keys, past.layers[layer].values))  # [H, T, D]
        k = kv[:, layer, 0].reshape(96, 1, 64).permute(1, 0, 2)
        v = kv[:, layer, 1].reshape(96, 1, 64).permute(1, 0, 2)
        assert torch.allclose(k, k_ref, atol=1e-4) and torch.allclose(v, v_ref, atol=1e-4)
    # another scope sees nothing of it
    assert tiered.kv_lookup(_kv_req("kv2", secrets.token_bytes(32), prompt))["hit_tokens"] == 0


def test_kv_api_uploads_stay_apart_and_never_feed_a_completion(tiered, site):
    scope = secrets.token_bytes(32)
    prompt = _prompt(130, 71)
    layout = tiered.kv_layout()
    kv = torch.randn(4, *layout["page_shape"])
    assert tiered.kv_store(_kv_req("up", scope, prompt), kv) == 4
    assert tiered.kv_lookup(_kv_req("up", scope, prompt)) == {"hit_tokens": 128, "origin": "upload"}
    got, mask, origin = tiered.kv_retrieve(_kv_req("up", scope, prompt))
    assert origin == "upload" and torch.equal(got, kv)
    # the web tier's calls: the same KV as plain bytes (workers.protocol.KVWire), no tensor crossing
    from workers.kv_wire import from_wire, to_wire

    wire = tiered.kv_retrieve_wire(_kv_req("up", scope, prompt))
    assert wire["hit_tokens"] == 128 and wire["origin"] == "upload" and torch.equal(from_wire(wire["kv"]), kv)
    other = _prompt(130, 74)
    assert tiered.kv_store_wire(_kv_req("up", scope, other), to_wire(kv)) == 4
    assert torch.equal(tiered.kv_retrieve(_kv_req("up", scope, other))[0], kv)
    assert tiered.kv_lookup(_kv_req("other", secrets.token_bytes(32), prompt))["hit_tokens"] == 0
    _reset_vllm(tiered)
    assert _run(tiered, site, "up", scope, prompt)["usage"]["cached_tokens"] == 0  # never the uploaded bytes
    bad = kv.clone()
    bad[0].view(-1)[0] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        tiered.kv_store(_kv_req("up", scope, _prompt(130, 72)), bad)
    with pytest.raises(Exception, match="shape"):
        tiered.kv_store(_kv_req("up", scope, _prompt(130, 73)), kv[:2])


def test_a_corrupt_l2_block_is_recomputed_from_it_on(tiered, site):
    from workers.kv_params import TransferParams as TP

    salt = secrets.token_bytes(32)
    prompt = _prompt(200, 81)
    cold = _run(tiered, site, "cx", salt, prompt, persist=False)
    rev = tiered._active
    wr = {"tenant": "cx", "scope_salt": salt, "prompt": prompt}
    from workers.protocol import WorkerRequest

    hashes = tiered._hashes(rev, WorkerRequest.from_dict(wr))
    assert TP.from_wire(tiered._transfer(rev, WorkerRequest.from_dict(wr), hashes)).hashes == tuple(hashes)
    assert tiered._tiers("corrupt_l2", hashes=hashes[3:4]) == 1
    _reset_vllm(tiered)
    warm = _run(tiered, site, "cx", salt, prompt, persist=False)
    assert warm["usage"]["cached_tokens"] == 3 * BS  # blocks 0-2 from L2, block 3 on recomputed
    assert warm["token_ids"] == cold["token_ids"]
    assert tiered.stats()["tiers"]["l2"]["corrupt_loads"] >= 1
    assert tiered.check_integrity()


def test_the_tiers_kv_events_reach_the_replica_s_log(tiered, site):
    """The router hears what Strata's L2 and L3 hold on a vLLM replica (tiers ``l2``/``l3`` of the
    replica's KV events), not only vLLM's derived device-cache blocks."""
    salt = secrets.token_bytes(32)
    prompt = _prompt(300, 91)
    before = tiered.kv_events(1)["seq"]
    _run(tiered, site, "ev", salt, prompt)
    page = tiered.kv_events(before + 1)
    stored = {ev["tier"]: len(ev["hashes"]) for b in page["batches"] for ev in b["events"] if ev["type"] == "stored"}
    assert stored.get("l2", 0) >= 9 and stored.get("l3", 0) >= 8
    snap = tiered.kv_snapshot()
    assert len(snap["tiers"]["l2"]) >= 9
    tiered.flush({"scope": "tenant", "tenant": "ev"})
    after = tiered.kv_events(page["seq"] + 1)
    removed = [ev for b in after["batches"] for ev in b["events"] if ev["type"] in ("removed", "cleared")]
    assert any(ev.get("tier") == "l2" for ev in removed)
