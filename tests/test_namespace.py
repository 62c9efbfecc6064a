"""Namespace: every field is part of the key, the encoding is unambiguous, the salt never leaks."""

from __future__ import annotations

import pickle

import pytest

from cachecore.errors import InvalidNamespace, UnknownNamespaceField
from cachecore.namespace import Namespace, canonical_encode

SALT_A = bytes(range(32))
SALT_B = bytes(range(1, 33))


def fields(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "scope_salt": SALT_A,
        "model_id": "llama-tiny",
        "weight_digest": "w" * 64,
        "tokenizer_digest": "t" * 64,
        "layout": {"dtype": "float32", "block_size": 16, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8},
        "rope": {"kind": "rope", "theta": 10000.0, "dim": 8},
        "lora_id": "",
        "tp_rank": 0,
        "tp_size": 1,
    }
    base.update(overrides)
    return base


def build(**overrides: object) -> Namespace:
    return Namespace.build(**fields(**overrides))  # type: ignore[arg-type]


def test_same_fields_give_same_digest_and_equal_namespaces():
    a, b = build(), build()
    assert a.digest == b.digest and a == b and hash(a) == hash(b)
    assert len(a.digest) == 32
    assert a != build(model_id="other")


@pytest.mark.parametrize(
    "field,value",
    [
        ("scope_salt", SALT_B),
        ("model_id", "llama-small"),
        ("weight_digest", "x" * 64),
        ("tokenizer_digest", "y" * 64),
        ("layout", {"dtype": "float16", "block_size": 16, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}),
        ("layout", {"dtype": "float32", "block_size": 32, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}),
        ("rope", {"kind": "rope", "theta": 500000.0, "dim": 8}),
        ("rope", {"kind": "rope", "theta": 10000.0, "dim": 8, "scaling": "linear"}),
        ("lora_id", "adapter-1"),
        ("tp_rank", 1),
        ("tp_size", 2),
    ],
)
def test_every_field_changes_the_digest(field, value):
    overrides = {field: value}
    if field == "tp_rank":
        overrides["tp_size"] = 2
    changed = build(**overrides)
    baseline = build(**({"tp_size": 2} if field == "tp_rank" else {}))
    assert changed.digest != baseline.digest
    assert build(**overrides).digest == changed.digest  # and the change itself is deterministic


def test_mapping_order_does_not_matter_but_value_types_do():
    forward = build(rope={"kind": "rope", "theta": 10000.0, "dim": 8})
    backward = build(rope={"dim": 8, "theta": 10000.0, "kind": "rope"})
    assert forward.digest == backward.digest
    assert build(rope={"kind": "rope", "theta": 10000, "dim": 8}).digest != forward.digest


def test_length_prefix_keeps_shifted_boundaries_apart():
    assert canonical_encode("org_1", "2345") != canonical_encode("org_12345", "")
    assert canonical_encode("org_1", "2345") == canonical_encode("org_1", "2345")
    left = build(model_id="org_1", lora_id="2345")
    right = build(model_id="org_12345", lora_id="")
    assert left.digest != right.digest
    assert build(model_id="org_1", lora_id="2345").digest == left.digest


def test_canonical_encode_distinguishes_types_and_nesting():
    encodings = {canonical_encode(p) for p in (1, 1.0, True, "1", b"1", None, (1,), [1], {"1": 1})}
    assert len(encodings) == 8  # (1,) and [1] are the same sequence on purpose
    assert canonical_encode((1,)) == canonical_encode([1])
    assert canonical_encode(("a", "b")) != canonical_encode(("ab",))
    assert canonical_encode(-0.0) == canonical_encode(0.0)
    with pytest.raises(ValueError):
        canonical_encode(float("nan"))
    with pytest.raises(TypeError):
        canonical_encode({1: "x"})
    with pytest.raises(TypeError):
        canonical_encode(object())


def test_unknown_field_raises_with_its_name():
    with pytest.raises(UnknownNamespaceField, match="colour"):
        Namespace.build(**fields(colour="blue"))  # type: ignore[arg-type]
    assert build().digest  # the known fields alone are accepted


@pytest.mark.parametrize(
    "overrides",
    [
        {"scope_salt": b"short"},
        {"scope_salt": bytes(33)},
        {"scope_salt": "a" * 32},
        {"scope_salt": bytearray(32)},
        {"model_id": ""},
        {"model_id": 7},
        {"weight_digest": b"w"},
        {"lora_id": None},
        {"layout": [("dtype", "float32")]},
        {"layout": {"block_size": 16.0}},
        {"layout": {"block_size": True}},
        {"rope": {"theta": float("inf")}},
        {"rope": {"theta": None}},
        {"tp_rank": 1},
        {"tp_size": 0},
        {"tp_rank": True},
    ],
)
def test_wrong_types_and_values_raise_invalid_namespace(overrides):
    with pytest.raises(InvalidNamespace):
        build(**overrides)


def test_scope_salt_and_digest_never_appear_in_repr_or_str():
    ns = build()
    for text in (repr(ns), str(ns), f"{ns}"):
        assert SALT_A.hex() not in text and repr(SALT_A) not in text
        assert ns.digest.hex() not in text
        assert ns.fingerprint in text
    assert not hasattr(ns, "scope_salt")


def test_fingerprint_is_short_hex_and_follows_the_digest():
    a, b = build(), build(scope_salt=SALT_B)
    assert len(a.fingerprint) == 12 and int(a.fingerprint, 16) >= 0
    assert a.fingerprint == build().fingerprint
    assert a.fingerprint != b.fingerprint
    assert a.fingerprint not in a.digest.hex()  # a hash of the digest, not a slice of it


def test_namespace_is_frozen_and_pickles():
    ns = build()
    with pytest.raises(AttributeError):
        ns.model_id = "other"  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(ns)) == ns
