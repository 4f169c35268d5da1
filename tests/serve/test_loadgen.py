"""The load generator: reproducible workloads, and `mlsys bench serve` against our own server."""

import json

import pytest

from mlsyslab.errors import InvalidValue
from mlsyslab.serve.loadgen import Workload
from tests.cli.test_cli import run


def test_workload_shapes():
    workload = Workload(requests=20, prompt_tokens=40, prompt_spread=0.5, output_tokens=10, shared_prefix=0.5, seed=3)
    prompts = workload.prompts()
    assert prompts == workload.prompts() and len(prompts) == 20
    assert all(20 <= len(ids) <= 60 and 5 <= new <= 15 for ids, new in prompts)
    assert len({tuple(ids[:20]) for ids, _ in prompts}) == 1  # the shared prefix
    assert len({tuple(ids[20:]) for ids, _ in prompts}) == 20
    with pytest.raises(InvalidValue, match="shared_prefix"):
        Workload(shared_prefix=1.5)


def test_bench_serve_with_prefix_ablation(capsys, monkeypatch):
    code, out, err = run(capsys, monkeypatch, "bench", "serve", "--requests", "6", "--concurrency", "2",
                         "--prompt-tokens", "96", "--output-tokens", "4", "--shared-prefix", "0.8",
                         "--prefix-ablation", "--threads", "2", "--kv-cache-gb", "0.2", "--json")
    assert code == 0, err
    reports = json.loads(out)
    on, off = reports["prefix cache on"], reports["prefix cache off"]
    assert on["completed"] == off["completed"] == 6 and on["failed"] == 0
    assert on["prefill_tokens"] < 0.6 * off["prefill_tokens"]  # 80% of every prompt after the first two is cached
    assert on["prefix_hit_rate"] > 0.4 and off["prefix_hit_rate"] == 0
    assert reports["prefix cache on/off"]["prefill_tokens"] == pytest.approx(on["prefill_tokens"] / off["prefill_tokens"])
    assert on["output_tokens_per_s"] > 0 and on["tpot_p50_s"] > 0


def test_bench_serve_fails_when_every_request_failed(capsys, monkeypatch):
    """A run in which no request completed prints its errors and exits 1, not 0 with empty numbers."""
    from mlsyslab.serve import loadgen

    def refused(url, model, workload, stream=True):
        return loadgen.BenchReport(url=url, workload={}, completed=0, failed=2, duration_s=0.1, output_tokens_per_s=0.0,
                                   requests_per_s=0.0, ttft_p50_s=float("nan"), ttft_p99_s=float("nan"),
                                   tpot_p50_s=float("nan"), tpot_p99_s=float("nan"), latency_p50_s=float("nan"),
                                   latency_p99_s=float("nan"), busy_cores_before=0.0, cores=2, trustworthy=True,
                                   errors=["HTTP 500: engine is not running"])

    monkeypatch.setattr(loadgen, "served_models", lambda url: {"m": None})
    monkeypatch.setattr(loadgen, "run_benchmark", refused)
    code, out, err = run(capsys, monkeypatch, "bench", "serve", "--url", "http://127.0.0.1:9/v1", "--requests", "2")
    assert code == 1 and "0 requests (2 failed)" in out and "HTTP 500" in err
