"""Hash chain: a key binds the namespace, the request salt, the extras and the whole prefix before it."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cachecore.errors import InvalidPrompt
from cachecore.hashing import chain_hashes, token_buffer
from cachecore.namespace import Namespace

BS = 4


def make_ns(salt_byte: int = 0, model_id: str = "m") -> Namespace:
    return Namespace.build(
        scope_salt=bytes([salt_byte]) * 32,
        model_id=model_id,
        weight_digest="w",
        tokenizer_digest="t",
        layout={"block_size": BS},
        rope={"theta": 10000.0},
    )


NS = make_ns()


def test_one_32_byte_hash_per_full_block_and_partial_blocks_ignored():
    hashes = chain_hashes(NS, list(range(11)), BS)
    assert len(hashes) == 2 and all(len(h) == 32 for h in hashes)
    assert chain_hashes(NS, list(range(8)), BS) == hashes  # the 3 trailing tokens changed nothing
    assert chain_hashes(NS, list(range(3)), BS) == []
    assert chain_hashes(NS, [], BS) == []


def test_same_prefix_gives_same_hashes_and_divergence_changes_only_later_blocks():
    a = chain_hashes(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], BS)
    b = chain_hashes(NS, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0], BS)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


def test_identical_block_after_a_different_predecessor_hashes_differently():
    a = chain_hashes(NS, [1, 1, 1, 1, 7, 7, 7, 7], BS)
    b = chain_hashes(NS, [2, 2, 2, 2, 7, 7, 7, 7], BS)
    assert a[1] != b[1]
    assert chain_hashes(NS, [1, 1, 1, 1, 7, 7, 7, 7], BS)[1] == a[1]


def test_namespace_keys_the_chain():
    tokens = list(range(8))
    assert chain_hashes(make_ns(1), tokens, BS) == chain_hashes(make_ns(1), tokens, BS)
    other_tenant = chain_hashes(make_ns(2), tokens, BS)
    other_model = chain_hashes(make_ns(1, model_id="m2"), tokens, BS)
    base = chain_hashes(make_ns(1), tokens, BS)
    assert not set(base) & set(other_tenant)
    assert not set(base) & set(other_model)


def test_request_salt_changes_every_block():
    tokens = list(range(12))
    plain = chain_hashes(NS, tokens, BS)
    salted = chain_hashes(NS, tokens, BS, request_salt=b"user-42")
    assert chain_hashes(NS, tokens, BS, request_salt=b"user-42") == salted
    assert all(p != s for p, s in zip(plain, salted, strict=True))
    assert chain_hashes(NS, tokens, BS, request_salt=b"") == plain


def test_extras_change_their_block_and_everything_after():
    tokens = list(range(12))
    plain = chain_hashes(NS, tokens, BS)
    with_image = chain_hashes(NS, tokens, BS, extras=[None, b"img:abc@0", None])
    assert with_image[0] == plain[0]
    assert with_image[1] != plain[1] and with_image[2] != plain[2]
    assert chain_hashes(NS, tokens, BS, extras=[None, None, None]) == plain
    assert chain_hashes(NS, tokens, BS, extras=[None, b"", None])[1] != plain[1]  # b"" is not None
    other_image = chain_hashes(NS, tokens, BS, extras=[None, b"img:abd@0", None])
    assert other_image[1] != with_image[1]


def test_extras_must_cover_every_full_block():
    with pytest.raises(ValueError):
        chain_hashes(NS, list(range(12)), BS, extras=[None, None])
    assert len(chain_hashes(NS, list(range(14)), BS, extras=[None, None, None, b"partial"])) == 3


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    split_block=st.integers(0, 10),
    salt=st.binary(max_size=8),
    with_extras=st.booleans(),
)
def test_incremental_hashing_equals_hashing_the_whole_sequence(tokens, split_block, salt, with_extras):
    n_full = len(tokens) // BS
    extras = [bytes([i]) if i % 2 else None for i in range(n_full)] if with_extras else None
    whole = chain_hashes(NS, tokens, BS, request_salt=salt, extras=extras)
    cut = min(split_block, n_full)
    head_extras = extras[:cut] if extras else None
    head = chain_hashes(NS, tokens[: cut * BS], BS, request_salt=salt, extras=head_extras)
    tail = chain_hashes(
        NS,
        tokens[cut * BS :],
        BS,
        request_salt=salt,
        parent=head[-1] if head else None,
        extras=extras[cut:] if extras else None,
    )
    assert head + tail == whole


def test_parent_binds_the_chain():
    first = chain_hashes(NS, [1, 2, 3, 4], BS)[0]
    other = chain_hashes(NS, [9, 9, 9, 9], BS)[0]
    after_first = chain_hashes(NS, [5, 6, 7, 8], BS, parent=first)
    assert after_first != chain_hashes(NS, [5, 6, 7, 8], BS, parent=other)
    assert after_first == chain_hashes(NS, [1, 2, 3, 4, 5, 6, 7, 8], BS)[1:]
    with pytest.raises(ValueError):
        chain_hashes(NS, [5, 6, 7, 8], BS, parent=b"short")


def test_list_tuple_and_numpy_inputs_agree():
    tokens = [0, 1, 2, 70000, 5, 6, 7, 2**32 - 1]
    expected = chain_hashes(NS, tokens, BS)
    assert chain_hashes(NS, tuple(tokens), BS) == expected
    assert chain_hashes(NS, np.array(tokens, dtype=np.int64), BS) == expected
    assert chain_hashes(NS, np.array(tokens, dtype=np.uint32), BS) == expected
    assert chain_hashes(NS, np.array(tokens, dtype=">u4"), BS) == expected  # byte order is normalised
    assert chain_hashes(NS, [np.int64(t) for t in tokens], BS) == expected
    assert chain_hashes(NS, [t + 1 for t in tokens[:-1]] + [0], BS) != expected


def test_key_is_blake2b_keyed_with_the_namespace_digest():
    # Pins the documented message layout, so other implementations (or a C port) can interoperate.
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    body = b"".join(t.to_bytes(4, "little") for t in tokens)
    header = BS.to_bytes(4, "little")
    h0 = hashlib.blake2b(
        b"\x00" + header + b"\x00" + (3).to_bytes(8, "little") + b"abc" + body[:16],
        key=NS.digest,
        digest_size=32,
    ).digest()
    h1 = hashlib.blake2b(b"\x01" + header + b"\x00" + h0 + body[16:], key=NS.digest, digest_size=32).digest()
    assert chain_hashes(NS, tokens, BS, request_salt=b"abc") == [h0, h1]


@pytest.mark.parametrize(
    "bad",
    [
        [1, 2, -1, 4],
        [1, 2, 3.0, 4],
        [1, 2, "3", 4],
        [1, None, 3, 4],
        [1, True, 3, 4],
        [False, 2, 3, 4],
        [np.True_, 2, 3, 4],
        [2**32, 1, 2, 3],
        np.array([1, -2, 3, 4]),
        np.array([1.0, 2.0, 3.0, 4.0]),
        np.array([True, False, True, False]),
        np.array([[1, 2], [3, 4]]),
    ],
)
def test_non_integer_bool_or_negative_tokens_raise_invalid_prompt(bad):
    with pytest.raises(InvalidPrompt):
        chain_hashes(NS, bad, BS)


@pytest.mark.parametrize("bad", ["abcd", b"\x01\x02\x03\x04", bytearray(4)])
def test_strings_and_bytes_are_not_token_sequences(bad):
    with pytest.raises(InvalidPrompt):
        chain_hashes(NS, bad, BS)
    assert chain_hashes(NS, range(4), BS) == chain_hashes(NS, [0, 1, 2, 3], BS)  # other iterables are fine


def test_token_buffer_accepts_zero_and_one_when_they_are_ints():
    assert token_buffer([0, 1, 1, 0]).tolist() == [0, 1, 1, 0]
    with pytest.raises(InvalidPrompt):
        token_buffer([0, 1, True, 0])


@pytest.mark.parametrize("block_size", [0, -4, 2.0, True])
def test_block_size_must_be_a_positive_int(block_size):
    with pytest.raises(ValueError):
        chain_hashes(NS, [1, 2, 3, 4], block_size)
