"""bench.throughput's quick path runs end to end (tiny model) and reports every figure it promises."""

from __future__ import annotations


def test_throughput_bench_quick_prints_its_tables_and_result_line(capsys):
    from bench import throughput

    fields = throughput.main(["--quick", "--preset", "tiny", "--system", "48", "--output", "4"])
    out = capsys.readouterr().out
    assert "serial" in out and "batched" in out and "under burst" in out and "fcfs" in out
    assert out.strip().splitlines()[-1].startswith("RESULT ")
    for key in ("speedup_16", "tps_16", "serial_tps_16", "p99_1_ms", "burst_p99_ratio", "hit_cache_aware",
                "hit_fcfs", "longest_wait_cache_aware_ms", "longest_wait_fcfs_ms"):
        assert key in fields
    assert float(fields["tps_16"]) > 0 and float(fields["serial_tps_16"]) > 0
    assert 0 <= float(fields["hit_cache_aware"]) <= 1 and "tps_64" not in fields  # quick skips 64 streams
