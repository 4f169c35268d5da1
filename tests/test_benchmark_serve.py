"""The batch-1 roofline bookkeeping of benchmarks/serve.py: each request against the readings around it."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # serve.py imports its neighbour record.py
    spec = importlib.util.spec_from_file_location("bench_serve", BENCHMARKS / "serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_serve"] = module  # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))
        del sys.modules["bench_serve"]


def test_each_request_is_held_against_the_readings_around_it(bench, monkeypatch):
    readings = iter([36e9, 37e9, 64e9, 66e9, 36e9])  # before the first request, then after each
    monkeypatch.setattr(bench, "read_bandwidth", lambda: next(readings))
    tpots = [0.008, 0.0079, 0.0055, 0.006]
    runs, fields = bench.phase_paired(100e6 * 2.7, len(tpots), lambda i: {"tpot_p50_s": tpots[i]})
    assert [r["tpot_p50_s"] for r in runs] == tpots
    pairs = fields["decode_roofline_runs"]
    assert [p["one_phase"] for p in pairs] == [True, False, True, False]  # 37 -> 64 and 66 -> 36 change phase
    assert pairs[0]["fraction"] == pytest.approx(270e6 / 37e9 / 0.008)  # the higher of the two readings
    assert pairs[2]["fraction"] == pytest.approx(270e6 / 66e9 / 0.0055)
    kept = [pairs[0]["fraction"], pairs[2]["fraction"]]
    assert fields["decode_roofline_fraction"] == pytest.approx(sum(kept) / 2)  # median of two
    assert fields["read_bandwidth_bytes_per_s"] == pytest.approx((37e9 + 66e9) / 2)


def test_no_request_in_one_phase_gives_no_fraction(bench, monkeypatch):
    readings = iter([36e9, 64e9, 36e9])
    monkeypatch.setattr(bench, "read_bandwidth", lambda: next(readings))
    _, fields = bench.phase_paired(270e6, 2, lambda i: {"tpot_p50_s": 0.008})
    assert fields["decode_roofline_fraction"] is None and len(fields["decode_roofline_runs"]) == 2


def test_a_failed_request_is_not_counted(bench, monkeypatch):
    monkeypatch.setattr(bench, "read_bandwidth", lambda: 36e9)
    tpots = [math.nan, 0.008]
    _, fields = bench.phase_paired(270e6, 2, lambda i: {"tpot_p50_s": tpots[i]})
    assert fields["decode_roofline_fraction"] == pytest.approx(270e6 / 36e9 / 0.008)


def test_requests_run_one_at_a_time_merge_into_one_load(bench):
    def report(tokens_per_s, duration_s, ttft_s, tpot_s, completed=1, errors=()):
        return {"output_tokens_per_s": tokens_per_s, "duration_s": duration_s, "ttft_p50_s": ttft_s,
                "ttft_p99_s": ttft_s, "tpot_p50_s": tpot_s, "tpot_p99_s": tpot_s, "completed": completed,
                "failed": 1 - completed, "errors": list(errors), "busy_cores_before": 0.1, "cores": 2}

    merged = bench.merged([report(100.0, 0.64, 0.1, 0.008), report(50.0, 1.28, 0.3, 0.012),
                           report(0.0, 0.5, math.nan, math.nan, completed=0, errors=["timeout"])])
    assert merged["output_tokens_per_s"] == pytest.approx((64 + 64) / (0.64 + 1.28 + 0.5))
    assert merged["ttft_p50_s"] == pytest.approx(0.2) and merged["tpot_p50_s"] == pytest.approx(0.010)
    assert merged["completed"] == 2 and merged["failed"] == 1 and merged["errors"] == ["timeout"]
