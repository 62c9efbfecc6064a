"""The engine's compute threads: every core but one by default, the operator's number when set."""

from __future__ import annotations

import pytest

from workers.config import WorkerConfig


@pytest.mark.parametrize(("cores", "want"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_default_leaves_one_core_to_the_loop_and_the_web_tier(cores, want):
    assert WorkerConfig().compute_threads(cores) == want


def test_strata_torch_threads_is_taken_as_given():
    cfg = WorkerConfig.from_env({"STRATA_TORCH_THREADS": "2"})
    assert cfg.compute_threads(2) == 2
    assert cfg.compute_threads(64) == 2
    assert WorkerConfig.from_env({}).compute_threads(8) == 7
