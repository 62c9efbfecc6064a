"""A cache worker (the plain class, no Ray) serving a Hugging Face checkpoint: transformers' greedy
tokens and text, exact reuse on the repeat, stop sequences, and a rollout to a second checkpoint of the
same layout (new weights: a new namespace, transformers' tokens of the new model)."""

from __future__ import annotations

import secrets

import pytest
import torch

from tests.hf_checkpoints import build_checkpoint
from tests.worker_calls import complete
from workers.cache_worker import CacheWorker

pytest.importorskip("transformers")

BS = 16
TEXT = "A cache keeps the attention keys and values of prompts that many requests share. Hello world! "


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-worker")
    first = build_checkpoint("qwen3", root / "r1", seed=31, layers=2)
    second = build_checkpoint("qwen3", root / "r2", seed=32, layers=2)
    worker = CacheWorker(deployment="hf-worker", preset="", device="cpu", l1_mb=4,
                         revision={"label": "r1", "checkpoint_path": str(root / "r1")})
    return worker, root, first, second


def _req(prompt: list[int], **extra) -> dict:
    return {"tenant": "t1", "scope_salt": SALT, "prompt": prompt, "max_tokens": 12,
            "temperature": 0, **extra}


SALT = secrets.token_bytes(32)


def _expected(hf, tok, ids: list[int], n: int = 12) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    return out[:out.index(eos) + 1] if eos in out else out


def test_worker_serves_transformers_tokens_and_reuses_the_prefix_exactly(setup):
    worker, _, (hf, tok), _ = setup
    ids = tok(TEXT * 2)["input_ids"]
    cold = complete(worker, _req(ids))
    warm = complete(worker, _req(ids))
    assert cold["token_ids"] == warm["token_ids"] == _expected(hf, tok, ids)
    assert cold["text"] == tok.decode(cold["token_ids"], skip_special_tokens=True)
    assert cold["usage"]["cached_tokens"] == 0
    assert warm["usage"]["cached_tokens"] == (len(ids) - 1) // BS * BS > 0
    info = worker.info()
    assert info["vocab_size"] == len(tok) and info["max_seq_len"] == hf.config.max_position_embeddings
    worker.check_integrity()


def test_worker_stops_at_a_stop_sequence(setup):
    worker, _, (_, tok), _ = setup
    ids = tok(TEXT)["input_ids"]
    whole = complete(worker, _req(ids, max_tokens=16))
    stop = whole["text"][3:6]
    assert len(stop) == 3 and stop not in whole["text"][:3]
    cut = complete(worker, _req(ids, max_tokens=16, stop=[stop]))
    assert cut["text"] == whole["text"][:whole["text"].index(stop)]
    assert cut["finish_reason"] == "stop"
    assert len(cut["token_ids"]) == cut["usage"]["completion_tokens"] <= len(whole["token_ids"])
    assert not worker.engine.running()  # the stopped generation released its blocks
    worker.check_integrity()


def test_rollout_to_another_checkpoint_is_a_new_namespace_with_the_new_models_tokens(setup):
    worker, root, (_, tok), (hf2, tok2) = setup
    ids = tok(TEXT * 2)["input_ids"]
    assert ids == tok2(TEXT * 2)["input_ids"]  # same tokenizer: only the weights differ
    before = complete(worker, _req(ids))
    staged = worker.stage_revision({"label": "r2", "checkpoint_path": str(root / "r2")})
    assert staged["weight_digest"] != worker.info()["weight_digest"]
    switched = worker.switch_revision("r2", drain_seconds=1)
    assert switched["switched"] and switched["revision"] == "r2"
    after = complete(worker, _req(ids))
    assert after["usage"]["cached_tokens"] == 0  # the old revision's KV is never served for the new one
    assert after["token_ids"] == _expected(hf2, tok2, ids) != before["token_ids"]
    again = complete(worker, _req(ids))
    assert again["usage"]["cached_tokens"] > 0 and again["token_ids"] == after["token_ids"]
    worker.check_integrity()
