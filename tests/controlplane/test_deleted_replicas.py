"""A deleted deployment's replicas stay gone in every process (issue 44, item 1): a revival that was
under way when the delete job stopped them never launches one again, and a name created again gets a
new directory of replicas, not the handles of the actors the job killed."""

from __future__ import annotations

import time

from controlplane.runtime import gateway
from tests.controlplane.test_replicas import FakeHandle, _wait_for, fleet  # noqa: F401  (fixture)


def test_a_replica_of_a_deleted_deployment_is_never_revived(fleet, monkeypatch):  # noqa: F811
    spec, rs, _ = fleet
    monkeypatch.setattr("controlplane.runtime.replicas.REVIVE_BACKOFF_S", (0.05, 0.05))
    rs._refresh = lambda: None  # the registry no longer has it
    rs.install(1, FakeHandle("r1"))
    rs.mark_dead(rs.replica(0), revive=True)
    _wait_for(lambda: not rs.replica(0).reviving)
    time.sleep(0.1)
    assert rs._actor.launched == [] and rs.replica(0).dead
    # the paired case: while the registry has it, the same revival launches it again
    rs._refresh = lambda: spec
    rs.mark_dead(rs.replica(0), revive=True)
    _wait_for(lambda: not rs.replica(0).dead)
    assert rs._actor.launched == [0]


def test_a_name_created_again_gets_a_new_directory_of_replicas():
    old = gateway.WorkerSpec(deployment="reborn", preset="tiny", revision={"label": "r1", "seed": 1},
                             deployment_id=1)
    first = gateway.replica_set(old)
    first.install(0, FakeHandle("killed"))
    try:
        assert gateway.replica_set(old) is first  # the same deployment keeps its directory
        new = gateway.WorkerSpec(deployment="reborn", preset="tiny", revision={"label": "r1", "seed": 1},
                                 deployment_id=2)
        second = gateway.replica_set(new)
        assert second is not first and first.closed and second.cached(0) is None
    finally:
        gateway.forget("reborn")
