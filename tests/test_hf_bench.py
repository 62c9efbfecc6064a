"""bench.model's quick path runs, measures both engines and checks they decoded the same tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_bench_model_quick_prints_its_table_and_result_line(capsys):
    from bench import model

    model.main(["--quick", "--prompt", "48", "--decode", "4", "--rounds", "1", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "strata runner" in out and "transformers" in out and "strata model" in out
    result = out.strip().splitlines()[-1]
    assert result.startswith("RESULT ")
    fields = dict(kv.split("=") for kv in result.split()[1:])
    assert fields["tokens_match"] == "1"
    assert float(fields["strata_prefill_tps"]) > 0 and float(fields["hf_decode_tps"]) > 0
    assert fields["device"] == "cpu" and fields["dtype"] == "float32"
