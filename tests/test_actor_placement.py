"""Where a replica actor goes (``workers.actor.placement``) and which engine it builds."""

from __future__ import annotations

import pytest

from workers.actor import build_worker, placement


def test_gpu_clusters_reserve_one_gpu_per_replica_or_its_tensor_parallel_size():
    assert placement({"GPU": 8.0})["num_gpus"] == 1
    assert placement({"GPU": 8.0}, tensor_parallel_size=4)["num_gpus"] == 4  # one actor: one node's GPUs
    assert placement({"CPU": 2.0})["num_gpus"] == 0
    assert placement({"CPU": 16.0, "strata_worker": 8.0})["resources"] == {"strata_worker": 1}


def test_the_strata_engine_refuses_tensor_parallelism_and_unknown_engines():
    with pytest.raises(ValueError, match="one device"):
        build_worker(engine="strata", tensor_parallel_size=2, deployment="x", preset="tiny",
                     revision={"label": "r1", "seed": 1})
    with pytest.raises(ValueError, match="unknown engine"):
        build_worker(engine="sglang", deployment="x", preset="tiny", revision={"label": "r1", "seed": 1})
