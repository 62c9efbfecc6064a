"""bench.vllm_cpu's workload: every measured prompt is one group's shared prefix plus a fresh question,
the groups interleaved, and the priming prompts carry the same prefixes; bad arguments are refused."""

from __future__ import annotations

import pytest

from bench.vllm_cpu import GROUPS, QUESTION, main, owners, workload


def test_the_batch_shares_the_primed_prefixes_group_by_group():
    ids = list(range(100, 400))
    prime, batch = workload(ids, 48, 16, seed=1)
    assert len(prime) == GROUPS and len(batch) == 16
    assert all(len(p) == 48 + QUESTION for p in prime + batch)
    for i, p in enumerate(batch):
        assert p[:48] == prime[i % GROUPS][:48]  # its group's prefix: a hit on both engines
        assert p[48:] != prime[i % GROUPS][48:]  # and its own question
    assert len({tuple(p[:48]) for p in prime}) == GROUPS  # the groups' prefixes differ
    assert workload(ids, 48, 16, seed=1) == (prime, batch) and workload(ids, 48, 16, seed=2) != (prime, batch)


@pytest.mark.parametrize(("flag", "value"), [("--streams", "0"), ("--output", "0"), ("--l1-mb", "0"),
                                           ("--threads", "-1")])
def test_bad_arguments_are_refused_before_anything_runs(flag, value):
    with pytest.raises(SystemExit) as exc:
        main([flag, value])
    assert exc.value.code == 2


def test_with_tenants_each_group_s_prompts_come_from_one_tenant_of_its_own():
    assert owners(8, 1) == ["a"] * 8
    many = owners(16, GROUPS)
    _, batch = workload(list(range(100, 400)), 48, 16, seed=1)
    by_prefix = {}
    for owner, p in zip(many, batch, strict=True):
        by_prefix.setdefault(tuple(p[:48]), set()).add(owner)
    assert len(by_prefix) == GROUPS and all(len(o) == 1 for o in by_prefix.values())
    assert len(set(many)) == GROUPS
