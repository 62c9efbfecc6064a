"""The replica board's plain class: states kept per replica, ``known_only`` reports, ``forget``."""

import pytest

from workers.replica_board import ReplicaBoard


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_repeated_state_keeps_its_since_and_a_new_one_starts_again():
    clock = Clock()
    board = ReplicaBoard(clock)
    board.report("cache-worker:m:0", "starting", "loading weights")
    clock.now = 105.0
    entry = board.report("cache-worker:m:0", "starting", "profiling memory")
    assert (entry["since"], entry["phase"], entry["updated"]) == (100.0, "profiling memory", 105.0)
    assert board.report("cache-worker:m:0", "ready")["since"] == 105.0
    with pytest.raises(ValueError):
        board.report("cache-worker:m:0", "sleeping")


def test_known_only_records_nothing_for_a_replica_the_board_never_held():
    board = ReplicaBoard(Clock())
    assert board.report("cache-worker:m:7", "stopped", known_only=True) == {}
    assert board.snapshot("cache-worker:m:") == {}
    board.report("cache-worker:m:0", "failed", error="out of memory")
    assert board.report("cache-worker:m:0", "stopped", known_only=True)["state"] == "stopped"


def test_forget_drops_one_deployments_states_only():
    board = ReplicaBoard(Clock())
    for name in ("cache-worker:m:0", "cache-worker:m:1", "cache-worker:m2:0"):
        board.report(name, "ready")
    assert board.forget("cache-worker:m:") == 2
    assert list(board.snapshot()) == ["cache-worker:m2:0"]
