"""`mlsys predict data|scaling|quantize|moe-imbalance|wafer` and `mlsys explain`: the JSON contract, the
numbers docs/walls.md states for seed claims 4, 5 and 10, and bad input as one stderr line with exit 2."""

import pytest

from tests.cli.test_cli import run, run_json


def test_data_claim_row_4(capsys, monkeypatch):
    default = run_json(capsys, monkeypatch, "predict", "data", "--hardware", "a100")
    assert default["step_s"] == pytest.approx(0.1009, abs=1e-4)
    assert default["utilisation"] == pytest.approx(0.946, abs=1e-3) and default["binding"] == "decode"
    claim = run_json(capsys, monkeypatch, "predict", "data", "--step-ms", "48", "--worker-rate", "133.33")
    assert claim["utilisation"] == pytest.approx(0.400, abs=1e-3) and claim["binding"] == "decode"
    mlsysim = run_json(capsys, monkeypatch, "predict", "data", "--step-ms", "41.88", "--worker-rate", "250")
    assert mlsysim["batch_s"] == pytest.approx(0.064) and mlsysim["utilisation"] == pytest.approx(0.654, abs=1e-3)
    assert set(default["stage_samples_per_s"]) == {"storage", "decode", "transfer", "accelerator"}
    assert default["assumptions"]["compute_efficiency"] == 0.2


def test_scaling(capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "predict", "scaling", "--params", "70e9", "--tokens", "1.4e12")
    assert report["compute_flops"] == pytest.approx(5.88e23)
    assert report["rule"]["parameters"] == pytest.approx(70e9)
    assert 15 < report["refit"]["tokens_per_parameter"] < 25


def test_quantize_claim_row_5(capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "predict", "quantize", "--model", "llama-3-8b", "--hardware", "h100")
    int8, int4 = report["rows"]
    assert int8["phases"]["decode"]["speedup"] == pytest.approx(1.98, abs=0.005)
    assert int4["phases"]["decode"]["speedup"] == pytest.approx(3.88, abs=0.005)
    assert int4["phases"]["training"]["speedup"] == pytest.approx(1.0)
    assert int4["phases"]["prefill"]["speedup"] == pytest.approx(1.0)
    low = run_json(capsys, monkeypatch, "predict", "quantize", "--model", "llama-3-8b", "--hardware", "h100",
                   "--low-precision-compute")
    assert low["rows"][0]["phases"]["training"]["speedup"] == pytest.approx(2.0, abs=0.005)
    assert low["rows"][1]["feasible"] is False and "no int4" in low["rows"][1]["reason"]


def test_moe_imbalance(capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "predict", "moe-imbalance", "--model", "mixtral-8x7b", "--tokens", "512")
    assert report["experts"] == 8 and report["top_k"] == 2 and report["mean_load"] == 128
    assert report["imbalance"] > 1 and 0 <= report["dropped_fraction"] < 0.01


def test_wafer_claim_row_10(capsys, monkeypatch):
    ideal = run_json(capsys, monkeypatch, "predict", "wafer", "--model", "gpt-3", "--injection-bw", "1.2 TB/s",
                     "--assume", "injection_efficiency=1")
    assert ideal["injection_s_per_layer"] == pytest.approx(3.03e-3, abs=5e-6) and ideal["bound"] == "injection"
    comparison = ideal["comparison"]
    assert comparison["layouts"][0]["feasible"] is False and comparison["layouts"][0]["time_s"] is None
    assert comparison["gpus"] == 8 and comparison["wafer_speedup"] == pytest.approx(0.665, abs=1e-3)
    real = run_json(capsys, monkeypatch, "predict", "wafer", "--model", "gpt-3", "--vs-hardware", "none")
    assert real["injection_s_per_layer"] == pytest.approx(30.3e-3, abs=5e-5) and real["comparison"] is None


def test_explain_json(capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "explain", "--model", "llama-3-8b", "--hardware", "a100", "--vs-hardware", "h100")
    assert report["a"]["binding"] == report["b"]["binding"] == "memory bandwidth"
    assert sum(report["attributions_s"].values()) == pytest.approx(report["change_s"])
    assert report["speedup"] == pytest.approx(1.643, abs=1e-3)
    training = run_json(capsys, monkeypatch, "explain", "--model", "llama-3-8b", "--hardware", "a100", "--vs-hardware",
                        "h100", "--workload", "training")
    assert max(training["attributions_s"], key=lambda k: abs(training["attributions_s"][k])) == "peak_flops"
    infeasible = run_json(capsys, monkeypatch, "explain", "--model", "llama-3-8b", "--hardware", "h100",
                          "--vs-model", "llama-3-70b")
    assert infeasible["b"]["feasible"] is False and infeasible["b"]["binding"] == "capacity"
    assert infeasible["ratio"] is None and infeasible["attributions_s"] == {}


@pytest.mark.parametrize("args, field", [
    (("predict", "data"), "--hardware"),
    # options of the other workload were ignored (2026-11-27 sweep)
    (("predict", "wafer", "--model", "llama-3-70b", "--phase", "decode", "--recompute"), "--recompute"),
    (("predict", "wafer", "--model", "llama-3-70b", "--phase", "training", "--vs-hardware", "none", "--vs-gpus", "5"),
     "--vs-gpus"),
    (("predict", "wafer", "--model", "llama-3-70b", "--phase", "training", "--vs-gpus", "83"), "--vs-gpus"),  # blamed
    # global_batch, which the user did not set
    (("schedule", "gpipe", "--forward", "1e308", "--backward", "1e308"), "--forward"),  # their sum: a nan bubble
    (("explain", "--model", "llama-3-8b", "--hardware", "h100", "--pp", "2"), "--pp"),
    (("explain", "--model", "llama-3-8b", "--hardware", "h100", "--workload", "training", "--vs-batch", "4"), "--vs-batch"),
    (("predict", "quantize", "--model", "llama-3-8b", "--hardware", "h100", "--weight-dtypes", "int8,,int4"),
     "--weight-dtypes"),  # the empty item was dropped
    (("predict", "data", "--hardware", "a100", "--workers", "-1"), "--workers"),
    (("predict", "data", "--step-ms", "40", "--storage-bw", "2 GB"), "--storage-bw"),
    (("predict", "scaling"), "--compute"),
    (("predict", "quantize", "--model", "llama-3-8b", "--hardware", "h100", "--weight-dtypes", "int3"), "--weight-dtypes"),
    (("predict", "moe-imbalance", "--experts", "8", "--top-k", "9"), "--top-k"),
    (("predict", "moe-imbalance", "--model", "llama-3-8b"), "--model"),
    (("predict", "wafer", "--model", "gpt-3", "--phase", "train"), "--phase"),
    (("predict", "wafer", "--model", "gpt-3", "--assume", "speed=2"), "assume"),
    (("explain", "--model", "llama-3-8b", "--hardware", "a100", "--vs-tp", "3"), "--vs-tp"),
    (("explain", "--model", "llama-3-8b", "--hardware", "a100", "--workload", "serve"), "--workload"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch, args, field):
    code, out, err = run(capsys, monkeypatch, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and field in err
