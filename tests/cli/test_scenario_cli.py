"""CLI faces of the fleet, operations and serving-capacity walls: JSON out, bad input exit 2."""

import pytest

from tests.cli.test_cli import run, run_json


def test_pruning_helps_where_its_regime_binds(capsys, monkeypatch):
    structured = run_json(capsys, monkeypatch, "predict", "prune", "--model", "llama-3-8b", "--hardware", "h100", "--structured")
    assert structured["speedup"]["training"] == pytest.approx(2.0) and 1.5 < structured["speedup"]["decode"] < 2.0
    half = run_json(capsys, monkeypatch, "predict", "prune", "--model", "llama-3-8b", "--hardware", "h100", "--density", "0.5")
    assert half["speedup"]["decode"] == pytest.approx(1.0)  # bf16 value + 16-bit index: no bytes saved
    assert half["speedup"]["training"] == pytest.approx(1.0)


def test_queue_prefix_and_disaggregation(capsys, monkeypatch):
    queue = run_json(capsys, monkeypatch, "predict", "queue", "--rate", "0.5", "--service-s", "1", "--servers", "1")
    assert queue["probability_of_waiting"] == pytest.approx(0.5) and queue["mean_wait_s"] == pytest.approx(1.0)
    prefix = run_json(capsys, monkeypatch, "predict", "prefix-cache", "--model", "llama-3-8b", "--hardware", "h100",
                      "--shared-fraction", "0.5", "--hit-rate", "1")
    assert prefix["prefill_fraction"] == pytest.approx(0.5) and prefix["ttft_ratio"] > 1.5
    pools = run_json(capsys, monkeypatch, "predict", "disaggregate", "--model", "llama-3-8b", "--hardware", "h100",
                     "--rate", "100")
    assert pools["prefill_gpus"] >= 1 and pools["decode_gpus"] >= 1 and pools["kv_transfer_s"] > 0


@pytest.mark.parametrize("args, field", [
    (["predict", "prune", "--model", "llama-3-8b", "--hardware", "h100", "--structured", "--density", "0.3"], "density"),
    (["predict", "queue", "--servers", "0"], "--servers"),
    (["predict", "prefix-cache", "--model", "llama-3-8b", "--hardware", "h100", "--hit-rate", "2"], "--hit-rate"),
    (["predict", "ops", "--region", "atlantis"], "grid"),
    (["predict", "fleet", "--gpus", "8"], "--params"),
    (["search", "-m", "llama-3-8b", "-H", "h100", "--constraint", "itl_s=<1"], "constraint"),
    (["search", "-m", "llama-3-8b", "-H", "h100", "--objective", "speed:max"], "metric"),
    # found by a sweep with bad input (2026-11-27): each was a traceback, a hang or a ranked nonsense
    (["search", "-m", "llama-3-8b", "-H", "h100", "--tp", "-1"], "--tp"),  # was ranked feasible
    (["search", "-m", "llama-3-8b", "-H", "h100", "--batch", "1.5"], "--batch"),
    (["search", "-m", "llama-3-8b", "-H", "h100", "--tp", "1,,2"], "--tp"),  # an empty item was dropped
    (["search", "-m", "llama-3-8b", "-H", "h100", "--weight-dtype", "bogus"], "--weight-dtype"),  # KeyError
    (["search", "-m", "llama-3-8b", "-H", "h100", "--constraint", "reason<=1"], "metric"),  # not a number
    (["search", "-m", "llama-3-8b", "-H", "h100", "--top", "0"], "--top"),
    (["search", "-m", "llama-3-8b", "-H", "h100", "--csv", "/no/such/folder/x.csv"], "--csv"),  # after the search
    (["search", "-m", "llama-3-8b", "-H", "h100", "--plot", "frontier.txt"], "--plot"),
    (["predict", "queue", "--servers", "10000000"], "--servers"),  # ran for minutes
    (["predict", "fleet", "--params", "8e9", "--interval-s", "-1"], "--interval-s"),  # -112% lost to checkpoints
    (["predict", "fleet", "--params", "8e9", "--model", "llama-3-8b"], "--params"),  # one was ignored
    (["predict", "fleet", "--params", "inf"], "--params"),
    (["predict", "ops", "--tokens-per-s", "-5"], "--tokens-per-s"),  # a negative cost per token
    (["predict", "disaggregate", "--model", "llama-3-8b", "--hardware", "h100", "--rate", "inf"], "--rate"),
    (["plan", "--model", "llama-3-8b", "--hardware", "h100", "--gpus", str(2**40)], "--gpus"),  # ran for minutes
    (["schedule", "gpipe", "--stages", "4", "--microbatches", "100000"], "--microbatches"),
    (["primer", "argmax", "--nproc", "100000"], "--nproc"),
    (["predict", "serve", "--model", "llama-3-8b", "--hardware", "h100", "--assume",
      "memory_bandwidth_efficiency=nan"], "memory_bandwidth_efficiency"),  # every time came out nan
    (["predict", "serve", "--model", "llama-3-8b", "--hardware", "h100", "--assume", "memory_usable_fraction=2"],
     "memory_usable_fraction"),
    # the checks `predict serve` makes, where other commands made none: TP dividing the heads, the context
    (["predict", "roofline", "--model", "llama-3-8b", "--hardware", "h100", "--tp", "3"], "--tp"),
    (["predict", "roofline", "--model", "llama-3-8b", "--hardware", "h100", "--seq", "100000"], "--seq"),
    (["predict", "roofline", "--model", "llama-3-8b", "--hardware", "h100", "--flops", "1", "--bytes", "1"], "--model"),
    (["predict", "kv-paging", "--model", "llama-3-8b", "--hardware", "h100", "--tp", "64"], "--tp"),
    (["predict", "kv-paging", "--model", "llama-3-8b", "--hardware", "h100", "--max-length", "100000"], "--max-length"),
    (["predict", "prefix-cache", "--model", "llama-3-8b", "--hardware", "h100", "--prompt-tokens", "100000"],
     "--prompt-tokens"),
    (["predict", "prune", "--model", "llama-3-8b", "--hardware", "h100", "--tp", "3"], "--tp"),
    (["predict", "reasoning", "--model", "llama-3-8b", "--hardware", "h100", "--steps", "40"], "--prompt-tokens"),
    (["predict", "serve", "--model", "llama-3-8b", "--hardware", "h100", "--prompt-tokens", "8000", "--output-tokens",
      "500"], "--prompt-tokens + --output-tokens=8500"),  # the sum, once printed as --prompt-tokens=8500
    (["predict", "reasoning", "--model", "llama-3-8b", "--hardware", "h100", "--baseline-usd-per-year", "-1"],
     "--baseline-usd-per-year"),
    (["sensitivity", "--model", "llama-3-8b", "--hardware", "h100", "--prompt-tokens", "100000"], "--prompt-tokens"),
    (["predict", "disaggregate", "--model", "llama-3-8b", "--hardware", "h100", "--prompt-tokens", "100000"],
     "--prompt-tokens"),
    (["predict", "prune", "--model", "llama-3.1-405b", "--hardware", "h100"], "fit"),  # speedups of what cannot run
    (["predict", "prefix-cache", "--model", "llama-3.1-405b", "--hardware", "h100"], "fit"),
    (["audit", "--serve", "--model", "llama-3-8b", "--hardware", "h100", "--gpus", "8"], "--gpus"),  # was ignored
    (["audit", "--model", "llama-3-8b", "--hardware", "h100", "--tp", "2"], "--tp"),  # was ignored
    (["audit", "--model", "llama-3-8b", "--hardware", "h100", "--out", "/proc/no-such-folder"], "--out"),  # traceback
])
def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch, args, field):
    code, out, err = run(capsys, monkeypatch, *args)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and field in err, err


def test_goodput_is_zero_where_checkpoints_or_failures_take_all_the_time(tmp_path, capsys, monkeypatch):
    """(1 − δ/τ)·(1 − (τ/2 + R)/M) with both factors negative came out positive (41.7%): each factor is clipped;
    the audit of such a job says it never finishes (it divided by zero or reported goodput 1)."""
    fleet = run_json(capsys, monkeypatch, "predict", "fleet", "-n", "100000", "--params", "1e12", "--storage-gbps", "2")
    assert fleet["checkpoint_overhead_fraction"] > 1 and fleet["failure_loss_fraction"] > 1 and fleet["goodput"] == 0
    audit = run_json(capsys, monkeypatch, "audit", "-m", "Llama-3.1-405B", "-H", "h100", "--gpus", "65536",
                     "--global-batch", "8192", "--storage-gbps", "2", "--out", str(tmp_path))
    assert audit["binding"].startswith("reliability") and not audit["sections"]["feasibility"]["feasible"]


def test_serving_audit_names_the_binding_constraint(tmp_path, capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "audit", "--serve", "--model", "llama-3-8b", "--hardware", "h100",
                      "--batch", "32", "--rate", "5", "--out", str(tmp_path))
    assert report["binding"] == "memory bandwidth"  # batch-32 decode of an 8B model reads its weights every step
    assert report["sections"]["compute"]["decode_bound"] == "memory"
    overloaded = run_json(capsys, monkeypatch, "audit", "--serve", "--model", "llama-3-8b", "--hardware", "h100",
                          "--batch", "8", "--rate", "4", "--out", str(tmp_path / "busy"))
    assert overloaded["binding"] == "queueing"
    assert (tmp_path / "report.md").read_text().startswith("# Audit") and (tmp_path / "step.png").exists()
