"""The CLI contract: --json prints one JSON object with the documented keys; bad input is one
stderr line naming the field, the value and what is valid, with exit code 2."""

import json
import subprocess
import sys

from pathlib import Path

import pytest

from mlsyslab.cli.main import main


def run(capsys, monkeypatch, *args):
    monkeypatch.setattr(sys, "argv", ["mlsys", *args])
    code = 0
    try:
        main()
    except SystemExit as done:
        code = done.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys, monkeypatch, *args):
    code, out, err = run(capsys, monkeypatch, *args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("has_bf16_dot", [False, True])
def test_predict_serve_on_local_takes_the_peak_our_engine_multiplies_bf16_at(capsys, monkeypatch, tmp_path,
                                                                            has_bf16_dot):
    """`--hardware local` predicts our engine: without a bf16 dot product it multiplies bf16 weights in fp32, so the
    fp32 peak (a calibrated torch bf16 matmul can be 40x slower there); the weights stay 2 bytes either way."""
    import yaml

    from mlsyslab.serve import config
    from mlsyslab.specs import catalog

    spec = {"accelerator": {"name": "local", "vendor": "this machine", "kind": "cpu", "launch_year": 2026,
                            "peak_flops": {"fp32": 100e9, "bf16": 2.5e9}, "hbm_bytes": 24e9, "hbm_bw": 25e9,
                            "sram_bytes": 1e6, "scale_up_bw": 1e15, "tdp_w": 1.0, "source": "test"},
            "system": {"name": "local", "accelerators_per_node": 1, "scale_up_domain": 1, "scale_out_bw": 1e15,
                       "pcie_bw": 25e9, "topology": "single-node", "source": "test"}}
    (tmp_path / "local.yaml").write_text(yaml.safe_dump(spec))
    monkeypatch.setattr(catalog, "LOCAL_HARDWARE", tmp_path / "local.yaml")
    monkeypatch.setattr(config, "cpu_has_bf16_dot", lambda: has_bf16_dot)
    serve = lambda dtype: run_json(capsys, monkeypatch, "predict", "serve", "--model", "SmolLM2-135M",  # noqa: E731
                                   "--hardware", "local", "--dtype", dtype, "--batch", "1", "--prompt-tokens", "128")
    bf16, fp32 = serve("bf16"), serve("fp32")
    assert bf16["weight_bytes_per_gpu"] == fp32["weight_bytes_per_gpu"] / 2
    assert (bf16["ttft_s"] > 10 * fp32["ttft_s"]) == has_bf16_dot  # at the 2.5 GFLOP/s bf16 peak only with a dot product
    assert (bf16["itl_s"] < fp32["itl_s"]) != has_bf16_dot  # else a decode step reads half the bytes at the same peak


TRAIN_KEYS = {"feasible", "reason", "step_s", "mfu", "hfu", "tflops_per_gpu", "memory_per_gpu_bytes",
              "time_breakdown_s", "assumptions"}


def test_predict_train_json(capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "predict", "train", "--model", "llama-3-8b", "--hardware", "h100",
                      "--gpus", "16", "--tp", "2", "--zero", "3", "--seq", "4096", "--global-batch", "64",
                      "--recompute", "selective", "--tokens", "1e12")
    assert TRAIN_KEYS <= report.keys()
    assert report["feasible"] and report["reason"] == ""
    assert 0 < report["mfu"] <= report["hfu"] < 1
    memory = report["memory_per_gpu_bytes"]
    parts = sum(memory[k] for k in ("weights", "gradients", "optimizer", "activations", "buffers"))
    assert parts == pytest.approx(memory["total"])
    assert sum(report["time_breakdown_s"].values()) == pytest.approx(report["step_s"])
    assert report["time_to_train_s"] == pytest.approx(1e12 / report["tokens_per_s"])
    assert report["layout"]["dp"] == 8 and report["layout"]["sequence_parallel"] is True


def test_predict_train_infeasible_is_reported_not_computed(capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "predict", "train", "--model", "llama-3-70b", "--hardware", "h100", "--gpus", "1")
    assert report["feasible"] is False and report["reason"] == "does not fit in memory"
    assert report["step_s"] is None and report["mfu"] is None
    assert report["memory_per_gpu_bytes"]["total"] > report["memory_per_gpu_bytes"]["capacity"]


def test_predict_serve_json(capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "predict", "serve", "--model", "llama-3-8b", "--hardware", "a100",
                      "--batch", "8", "--prompt-tokens", "2048", "--output-tokens", "128")
    for key in ("ttft_s", "itl_s", "kv_bytes_per_token", "max_concurrency", "tokens_per_s", "bound"):
        assert key in report
    assert report["kv_bytes_per_token"] == 131072 and report["bound"] == "memory"
    assert report["tokens_per_s"] == pytest.approx(8 / report["itl_s"])


def test_plan_json_ranks_feasible_layouts(capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "plan", "--model", "llama-3-70b", "--hardware", "h100", "--gpus", "64",
                      "--global-batch", "256", "--seq", "4096", "--top", "5")
    assert len(report["plans"]) == 5
    assert report["evaluated"] == report["feasible"] + sum(report["infeasible"].values())
    speeds = [p["tokens_per_s"] for p in report["plans"]]
    assert speeds == sorted(speeds, reverse=True)
    assert all(p["feasible"] for p in report["plans"])


def test_zoo_json(capsys, monkeypatch):
    assert len(run_json(capsys, monkeypatch, "zoo", "hardware")["accelerators"]) >= 30
    assert len(run_json(capsys, monkeypatch, "zoo", "models")["models"]) >= 25
    smol = run_json(capsys, monkeypatch, "zoo", "models", "SmolLM2-135M")
    assert smol["params"] == pytest.approx(134.5e6, rel=0.01)


def test_roofline_json(capsys, monkeypatch):
    decode = run_json(capsys, monkeypatch, "predict", "roofline", "--model", "llama-3-8b", "--hardware", "a100")
    prefill = run_json(capsys, monkeypatch, "predict", "roofline", "--model", "llama-3-8b", "--hardware", "a100",
                       "--phase", "prefill")
    assert decode["bound"] == "memory" and decode["intensity_flop_per_byte"] < 2
    assert prefill["bound"] == "compute" and prefill["intensity_flop_per_byte"] > prefill["ridge_flop_per_byte"]


@pytest.mark.parametrize("args, field", [
    (["predict", "train", "--model", "llama-3-70b", "--hardware", "h100", "--gpus", "6", "--tp", "6"], "tp"),
    (["predict", "train", "--model", "llama-3-70b", "--hardware", "h100", "--gpus", "96", "--pp", "96"], "pp"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--gpus", "8", "--ep", "2"], "ep"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--gpus", "6", "--tp", "4"], "--gpus"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--zero", "4"], "--zero"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--recompute", "some"], "--recompute"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "v100", "--dtype", "bf16"], "dtype"),
    (["predict", "train", "--model", "no-such-model", "--hardware", "h100"], "models"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h1000"], "hardware"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--assume", "warp_speed=9"], "assume"),
    (["predict", "serve", "--model", "llama-3-8b", "--hardware", "h100", "--batch", "0"], "--batch"),
    (["predict", "serve", "--model", "llama-3-8b", "--hardware", "h100", "--prompt-tokens", "9000"], "--prompt-tokens"),
    (["plan", "--model", "llama-3-8b", "--hardware", "h100", "--gpus", "0"], "--gpus"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--gpus", "eight"], "--gpus"),
    (["predict", "speculative", "--acceptance", "nan"], "--acceptance"),  # NaN is outside every range
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--gpus", str(2**70)], "--gpus"),  # traceback
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--global-batch", str(2**70)], "--global-batch"),
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--tokens", "-1"], "--tokens"),  # -11.7 µs
    (["predict", "train", "--model", "llama-3-8b", "--hardware", "h100", "--assume", "matmul_efficiency_max=0.5",
      "--assume", "matmul_efficiency_max=0.6"], "twice"),  # the last one was kept without a word
    (["bench", "serve", "--url", "http://127.0.0.1:9/v1", "--dtype", "bf16"], "--dtype"),  # was ignored
    (["bench", "serve", "--url", "http://[::1", "--requests", "1"], "--url"),  # httpx.InvalidURL traceback
])
def test_bad_input_is_one_line_and_exit_2(capsys, monkeypatch, args, field):
    code, out, err = run(capsys, monkeypatch, *args)
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and field in lines[0], err


def test_a_layout_breaking_several_rules_is_refused_naming_each(capsys, monkeypatch):
    """TP not dividing the heads and PP over the layers, in one line (the first alone was named)."""
    code, _, err = run(capsys, monkeypatch, "predict", "train", "--model", "smollm2-135m", "--hardware", "h100",
                       "--gpus", "128", "--tp", "4", "--pp", "32")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "tp=4 is invalid" in err and "9 attention heads" in err and "pp=32 is invalid" in err and "30 layers" in err


def test_a_pipeline_need_not_divide_the_layers(capsys, monkeypatch):
    """DeepSeek-V3 trained its 61 layers on PP 16: the cost-balanced split gives the stages unequal layers (predict
    refused any PP but 1 and 61 for it)."""
    code, out, _ = run(capsys, monkeypatch, "predict", "train", "--model", "deepseek-v3", "--hardware", "h100",
                       "--gpus", "2048", "--pp", "16", "--ep", "64", "--global-batch", "15360", "--seq", "4096",
                       "--micro-batch", "1", "--zero", "1", "--json")
    assert code == 0
    stages = json.loads(out)["stage_layers"]
    assert stages["first"] + stages["last"] < 61 and stages["first"] != 61 / 16


def test_explain_lists_every_assumption(capsys, monkeypatch):
    code, out, _ = run(capsys, monkeypatch, "predict", "train", "--model", "gpt2", "--hardware", "a100", "--explain")
    assert code == 0
    from mlsyslab.predict.assumptions import Assumptions
    for name in Assumptions().explain():
        assert name in out


def test_assume_changes_the_prediction(capsys, monkeypatch):
    args = ["predict", "train", "--model", "gpt2", "--hardware", "a100", "--gpus", "8"]
    base = run_json(capsys, monkeypatch, *args)
    slower = run_json(capsys, monkeypatch, *args, "--assume", "matmul_efficiency_max=0.4")
    assert slower["step_s"] > base["step_s"] and slower["assumptions"]["matmul_efficiency_max"] == 0.4


HARDWARE_SPEC = ("accelerator:\n  name: my-chip\n  vendor: me\n  launch_year: 2026\n"
                 "  peak_flops: {bf16: 100 TFLOP/s}\n  hbm_bytes: 16 GB\n  hbm_bw: 1 TB/s\n"
                 "  sram_bytes: 10 MB\n  scale_up_bw: 100 GB/s\n  tdp_w: 300 W\n  source: my datasheet\n"
                 "system:\n  name: my-box\n  accelerators_per_node: 4\n  scale_up_domain: 4\n"
                 "  scale_out_bw: 100 Gb/s\n  source: my rack\n")


def test_custom_model_and_hardware_files(tmp_path, capsys, monkeypatch):
    model = tmp_path / "model.yaml"
    model.write_text("name: tiny\nsource: test file\nfamily: llama\nhidden: 256\nlayers: 4\nheads: 4\n"
                     "ffn_hidden: 1024\nvocab: 1000\nmax_seq: 512\npublished_params: 3.4e6\n")
    hardware = tmp_path / "hw.yaml"
    hardware.write_text(HARDWARE_SPEC)
    report = run_json(capsys, monkeypatch, "predict", "train", "--model-spec", str(model), "--hardware-spec",
                      str(hardware), "--gpus", "4", "--seq", "512")
    assert report["feasible"] and report["model"] == "tiny" and report["hardware"] == "my-box"
    code, _, err = run(capsys, monkeypatch, "predict", "train", "--model-spec", str(tmp_path / "missing.yaml"),
                       "--hardware", "h100")
    assert code == 2 and "--model-spec" in err


@pytest.mark.parametrize("line, replacement, field", [
    ("  peak_flops: {bf16: 100 TFLOP/s}", "  peak_flops: {bf16: -100 TFLOP/s}", "peak_flops.bf16"),  # MFU -253%
    ("  peak_flops: {bf16: 100 TFLOP/s}", "  peak_flops: {}", "peak_flops"),
    ("  hbm_bw: 1 TB/s", "  hbm_bw: 0 TB/s", "hbm_bw"),  # every latency infinite
    ("  hbm_bw: 1 TB/s", "  hbm_bw: 1e400 TB/s", "hbm_bw"),
    ("  hbm_bytes: 16 GB", "  hbm_bytes: -80 GB", "hbm_bytes"),
    ("  scale_out_bw: 100 Gb/s", "  scale_out_bw: 0 Gb/s", "scale_out_bw"),  # step time nan
    ("  tdp_w: 300 W", "  tdp_w: -700 W", "tdp_w"),
    ("  launch_year: 2026", "  launch_year: -5", "launch_year"),
    ("  name: my-box", "  name: my-box\n  accelerator: another-chip", "system.accelerator"),  # silently ignored
])
def test_impossible_hardware_in_a_spec_is_refused(tmp_path, capsys, monkeypatch, line, replacement, field):
    """Found by a sweep with bad input (2026-11-27): each of these was taken as given."""
    hardware = tmp_path / "hw.yaml"
    hardware.write_text(HARDWARE_SPEC.replace(line, replacement))
    code, out, err = run(capsys, monkeypatch, "predict", "train", "--model", "gpt2", "--hardware-spec", str(hardware),
                         "--gpus", "4")
    assert code == 2 and out == "" and field in err and len(err.strip().splitlines()) == 1, err


def test_an_odd_sequence_is_valid_without_context_parallelism(capsys, monkeypatch):
    """Zig-zag CP needs 2·cp chunks; with cp = 1 there are none (an odd --seq was refused, blaming CP or the batch)."""
    args = ("--model", "llama-3-8b", "--hardware", "h100", "--gpus", "8", "--seq", "2047")
    assert run_json(capsys, monkeypatch, "predict", "train", *args, "--zero", "3", "--recompute", "full")["feasible"]
    assert run_json(capsys, monkeypatch, "plan", *args, "--top", "3")["feasible"] > 0
    code, _, err = run(capsys, monkeypatch, "predict", "train", *args, "--cp", "2")
    assert code == 2 and "cp" in err


def test_a_hardware_spec_with_an_unknown_assumption_is_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """A spec an older version wrote (an assumption since renamed) names the stale key, for predict and for train."""
    hardware = tmp_path / "old.yaml"
    hardware.write_text("accelerator:\n  name: old\n  vendor: me\n  launch_year: 2026\n  peak_flops: {fp32: 100 GFLOP/s}\n"
                        "  hbm_bytes: 16 GB\n  hbm_bw: 20 GB/s\n  sram_bytes: 1 MB\n  scale_up_bw: 1 GB/s\n  tdp_w: 1 W\n"
                        "  source: a calibration\nsystem:\n  name: old-box\n  accelerators_per_node: 2\n"
                        "  scale_up_domain: 2\n  scale_out_bw: 1 GB/s\n  source: a calibration\n"
                        "assumptions:\n  tensor_parallel_latency_factor: 0.2\n")
    for command in (["predict", "train", "--model", "gpt2", "--gpus", "2", "--dtype", "fp32"],
                    ["train", "--model-spec", str(Path(__file__).parents[2] / "examples" / "llama-tiny.yaml"), "--steps", "1"]):
        code, out, err = run(capsys, monkeypatch, *command, "--hardware-spec", str(hardware))
        assert code == 2 and "assumptions='tensor_parallel_latency_factor'" in err and "unknown assumption" in err, err
        assert "shared_memory_latency_factor" in err and out == ""


def test_console_script_runs():
    result = subprocess.run(["mlsys", "predict", "serve", "--model", "smollm2-135m", "--hardware", "l4", "--json"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["feasible"] is True


def test_audit_writes_a_report_naming_the_binding_constraint(tmp_path, capsys, monkeypatch):
    report = run_json(capsys, monkeypatch, "audit", "--model", "llama-3-8b", "--hardware", "h100", "--gpus", "64",
                      "--global-batch", "256", "--seq", "4096", "--region", "quebec", "--out", str(tmp_path))
    assert report["binding"] in ("compute", "communication", "pipeline bubble", "optimizer", "reliability")
    for wall in ("compute", "memory", "communication", "data", "reliability", "energy", "carbon", "cost"):
        assert wall in report["sections"]
    text = (tmp_path / "report.md").read_text()
    assert f"Binding constraint: {report['binding']}" in text and all(Path(f).exists() for f in report["figures"])
    nothing = run_json(capsys, monkeypatch, "audit", "--model", "llama-3-70b", "--hardware", "h100", "--gpus", "2",
                       "--global-batch", "8", "--out", str(tmp_path / "small"))
    assert nothing["sections"]["feasibility"]["feasible"] is False and "does not fit in memory" in nothing["sections"]["feasibility"]["reasons"]


def test_schedule_simulates_draws_and_refuses_bad_input(capsys, monkeypatch, tmp_path):
    """`mlsys schedule`: the schedule object's actions, its simulated bubble equal to the analytic one, the
    activations 1F1B holds (p − rank), PipeDream's weight versions, and the chart and trace written."""
    chart, trace = tmp_path / "1f1b.png", tmp_path / "1f1b.json"
    report = run_json(capsys, monkeypatch, "schedule", "1f1b", "--stages", "4", "--microbatches", "8",
                      "--png", str(chart), "--trace", str(trace))
    assert report["actions"][3][:4] == ["F0", "B0", "F1", "B1"] and len(report["actions"][0]) == 16
    assert report["bubble"]["simulated"] == pytest.approx(report["bubble"]["analytic"]) == pytest.approx(3 / 11)
    assert report["peak_in_flight"] == [4, 3, 2, 1] and report["weight_versions"] is None
    assert chart.stat().st_size > 5000 and len(json.loads(trace.read_text())["traceEvents"]) == 4 * 16
    pipedream = run_json(capsys, monkeypatch, "schedule", "pipedream", "--stages", "3", "--microbatches", "4")
    assert pipedream["weight_versions"][0] == {"0": 0, "1": 0, "2": 0, "3": 1}
    for args, field in ((["zigzag"], "schedule"), (["1f1b", "--forward", "0"], "--forward"),
                        (["interleaved", "--interleave", "2", "--microbatches", "6"], "microbatches"),
                        (["gpipe", "--interleave", "2"], "interleave"),
                        (["1f1b", "--png", str(tmp_path / "chart.svg")], "--png")):
        code, _, err = run(capsys, monkeypatch, "schedule", *args)
        assert code == 2 and err.startswith(f"error: {field}="), err
