"""bench.adapters: requests spread round-robin over the adapters, bad arguments refused before anything
runs, and a quick run end to end on vLLM's CPU build (one engine: the base model, then 1 and 4 adapters)
that prints its table and RESULT line; no figure is asserted (a shared, noisy machine), only that every
case was measured."""

from __future__ import annotations

import pytest

from bench.adapters import main, parse_counts, spread


def test_requests_spread_round_robin_over_the_adapters_or_none_for_the_base():
    assert spread(4, 0) == [None] * 4
    assert spread(16, 1) == [0] * 16
    assert spread(16, 4) == [0, 1, 2, 3] * 4
    assert sorted(spread(16, 16)) == list(range(16))
    assert parse_counts("1,4,16") == [1, 4, 16]


@pytest.mark.parametrize("argv", [["--streams", "0"], ["--output", "0"], ["--max-loras", "0"],
                                  ["--adapters", "0"], ["--adapters", "1,1"], ["--adapters", "x"]])
def test_bad_arguments_are_refused_before_anything_runs(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


@pytest.mark.slow
def test_quick_run_prints_the_base_and_each_adapter_count_and_a_result_line(capsys):
    pytest.importorskip("vllm")
    result = main(["--quick", "--streams", "4", "--output", "4", "--adapters", "1,4"])
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[-1:] and line.split()[-1].endswith("x")]
    assert [r[0] for r in rows] == ["base", "1", "4"] and rows[0][-1] == "1.00x"
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    assert line.split()[1].startswith("base_tok_s=")
    assert set(result) >= {"base_tok_s", "a1_tok_s", "a4_tok_s", "a1_vs_base", "a4_vs_base"}
    assert all(float(result[k]) > 0 for k in ("base_tok_s", "a1_tok_s", "a4_tok_s"))
