"""Incremental decoding and OpenAI ``stop`` sequences (workers/stops.py), on a byte-level BPE tokenizer
(multi-byte characters split across tokens) and on the byte tokenizer."""

from __future__ import annotations

import pytest

from cachecore.model.tokenizer import ByteTokenizer
from tests.hf_checkpoints import build_checkpoint
from workers.stops import TextStream, apply_stops, normalize_stops

pytest.importorskip("transformers")

TEXT = "Hello world! Ünïcödé 🙂 漢字. How are you today? STOP here, then more text."


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from cachecore.model.hf_tokenizer import load_text

    path = tmp_path_factory.mktemp("stops")
    build_checkpoint("qwen2", path, layers=1)
    return load_text(path)[0]


def _events(tokenizer, text: str, finish: str = "length"):
    ids = tokenizer.encode(text, add_bos=False)
    yield {"type": "prefilled", "prompt_tokens": 5, "cached_tokens": 0, "revision": "r1"}
    for i in ids:
        yield {"type": "token", "id": i, "text": tokenizer.decode([i]), "logprob": -0.5, "top_logprobs": None}
    yield {"type": "finished", "finish_reason": finish, "revision": "r1",
           "usage": {"prompt_tokens": 5, "completion_tokens": len(ids), "total_tokens": 5 + len(ids),
                     "cached_tokens": 0}}


def _run(tokenizer, text, stop):
    out = list(apply_stops(_events(tokenizer, text), tokenizer, stop))
    tokens = [e for e in out if e["type"] == "token"]
    return "".join(t["text"] for t in tokens), tokens, out[-1]


def test_per_token_decode_breaks_characters_but_the_stream_does_not(hf_tokenizer):
    ids = hf_tokenizer.encode(TEXT, add_bos=False)
    assert "\ufffd" in "".join(hf_tokenizer.decode([i]) for i in ids)  # why token texts are re-decoded
    text, tokens, finished = _run(hf_tokenizer, TEXT, None)
    assert text == hf_tokenizer.decode(ids) == TEXT
    assert [t["id"] for t in tokens] == ids  # still one event per token
    assert finished["finish_reason"] == "length"


@pytest.mark.parametrize("stop", ["STOP", ["nothing", "🙂"], ["How are", "world"], "漢"])
def test_generation_ends_before_the_first_stop_sequence(hf_tokenizer, stop):
    stops = [stop] if isinstance(stop, str) else stop
    cut = min(TEXT.find(s) for s in stops if s in TEXT)
    text, tokens, finished = _run(hf_tokenizer, TEXT, stop)
    assert text == TEXT[:cut]
    assert not any(s in text for s in stops)
    assert finished["finish_reason"] == "stop"
    assert finished["usage"]["completion_tokens"] == len(tokens) < len(hf_tokenizer.encode(TEXT, add_bos=False))


def test_a_stop_that_never_appears_changes_nothing(hf_tokenizer):
    text, tokens, finished = _run(hf_tokenizer, TEXT, ["never", "STOPPED"])
    assert text == TEXT
    assert finished["finish_reason"] == "length"
    assert finished["usage"]["completion_tokens"] == len(tokens)


def test_text_that_might_begin_a_stop_is_held_until_it_cannot():
    stream = TextStream(ByteTokenizer(), ["abc"])
    pieces = [stream.push(b) for b in b"xxab"]
    assert pieces == ["x", "x", "", ""]  # "ab" could become "abc"
    assert stream.push(ord("d")) == "abd"  # it did not
    assert [stream.push(b) for b in b"abc"] == ["", "", ""]
    assert stream.stopped
    assert stream.push(ord("z")) == ""  # nothing after a stop


def test_stopping_closes_the_generation(hf_tokenizer):
    closed = []

    def events():
        try:
            yield from _events(hf_tokenizer, TEXT)
        finally:
            closed.append(True)

    out = list(apply_stops(events(), hf_tokenizer, "world"))
    assert closed == [True]
    assert out[-1]["finish_reason"] == "stop"
    assert "".join(e["text"] for e in out if e["type"] == "token") == "Hello "


def test_byte_tokenizer_text_is_unchanged_without_stops():
    tok = ByteTokenizer()
    text, tokens, _ = _run(tok, "plain ascii text", None)
    assert text == "plain ascii text"
    assert [t["text"] for t in tokens] == list("plain ascii text")


@pytest.mark.parametrize("bad", ["", ["a"] * 5, [1], ["x" * 300], {"a": 1}])
def test_malformed_stop_is_refused(bad):
    with pytest.raises(ValueError):
        normalize_stops(bad)
    assert normalize_stops(["a", "a", "b"]) == ("a", "b")
    assert normalize_stops(None) == ()
