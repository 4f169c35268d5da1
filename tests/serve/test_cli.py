"""`mlsys generate` and `mlsys serve` end to end; bad options are one stderr line and exit code 2."""

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.cli.test_cli import run


def test_generate_json(capsys, monkeypatch):
    code, out, err = run(capsys, monkeypatch, "generate", "What is the capital of France?", "--threads", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["text"] == "The capital of France is Paris." and report["finish_reason"] == "stop"
    assert report["completion_tokens"] == 8 and report["decode_tokens_per_s"] > 0
    code, out, err = run(capsys, monkeypatch, "generate", "What is the capital of France?", "--threads", "2", "--json",
                         "--speculative-tokens", "4")
    assert code == 0 and json.loads(out)["text"] == report["text"], err



def test_generate_holds_a_prompt_as_long_as_the_models_context(capsys, monkeypatch):
    """Its KV cache covers the model's whole context for its one sequence (a fixed 0.2 GB refused 5,000 tokens of
    SmolLM2's 8,192, naming a budget it had no option for)."""
    from mlsyslab.serve import engine

    configs = []
    original = engine.LLM.__init__

    def recording(self, *args, config, **kwargs):
        configs.append(config)
        original(self, *args, config=config, **kwargs)

    monkeypatch.setattr(engine.LLM, "__init__", recording)
    code, _, err = run(capsys, monkeypatch, "generate", "hi", "--max-tokens", "1", "--dtype", "bf16")
    assert code == 0, err
    per_token = 2 * 30 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, bf16
    assert configs[0].kv_cache_bytes >= per_token * 8192


def test_bench_serve_exits_1_when_any_request_failed_and_prints_n_a_for_what_it_could_not_measure(capsys, monkeypatch):
    """One request of two failing (a prompt over the server's context) is exit 1, as all failing is; TTFT and TPOT
    that nothing measured print as n/a, not "nan ms"."""
    from mlsyslab.cli import serve_commands
    from mlsyslab.serve import loadgen

    nan = float("nan")
    report = loadgen.BenchReport("http://x/v1", {}, 1, 1, 1.0, 10.0, 1.0, 0.05, 0.05, nan, nan, 0.1, 0.1, 0.0, 2, True,
                                 ["HTTP 400: prompt tokens=10755 is invalid"])
    monkeypatch.setattr(serve_commands, "model_at", lambda url, name: ("m", None))
    monkeypatch.setattr(loadgen, "run_benchmark", lambda *args, **kwargs: report)
    code, out, err = run(capsys, monkeypatch, "bench", "serve", "--url", "http://x/v1", "--requests", "2")
    assert code == 1 and "(1 failed)" in out and "TPOT p50 n/a" in out and "nan" not in out, (out, err)


def test_generate_prints_the_reply_then_its_speed(capsys, monkeypatch):
    code, out, err = run(capsys, monkeypatch, "generate", "What is the capital of France?", "--threads", "2")
    assert code == 0 and out == "The capital of France is Paris.\n" and "finish: stop" in err, (out, err)


def test_generate_under_a_json_schema_or_a_regex(capsys, monkeypatch, tmp_path):
    schema = tmp_path / "capital.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
                                  "required": ["capital"], "additionalProperties": False}))
    code, out, err = run(capsys, monkeypatch, "generate", "What is the capital of France? Answer in JSON.", "--threads",
                         "2", "--json", "--json-schema", str(schema))
    assert code == 0, err
    assert set(json.loads(json.loads(out)["text"])) == {"capital"}
    code, out, err = run(capsys, monkeypatch, "generate", "Give me a year.", "--threads", "2", "--json", "--regex",
                         "[12][0-9]{3}")
    assert code == 0 and re.fullmatch("[12][0-9]{3}", json.loads(out)["text"]), (out, err)


@pytest.mark.parametrize("args, field", [(["generate", "hi", "--dtype", "fp16"], "--dtype"),
                                         (["generate", "hi", "--temperature", "-1"], "temperature"),
                                         (["generate", "hi", "--model", "/no/such.gguf"], "model"),
                                         (["serve", "--port", "70000"], "--port"),
                                         (["serve", "--kv-cache-gb", "0"], "--kv-cache-gb"),
                                         (["serve", "--decode-steps", "0"], "--decode-steps"),
                                         (["serve", "--speculative-tokens", "-1"], "--speculative-tokens"),
                                         (["serve", "--tool-call-parser", "pythonic"], "--tool-call-parser"),
                                         (["serve", "--reasoning-parser", "granite"], "--reasoning-parser"),
                                         (["serve", "--served-model-name", " "], "--served-model-name"),
                                         (["serve", "--host", "no-such-host.invalid"], "--host"),
                                         (["generate", "hi", "--json-schema", "{not json"], "--json-schema"),
                                         (["generate", "hi", "--json-schema", "[1]"], "--json-schema"),
                                         (["generate", "hi", "--json-schema", "/no/such/schema.json"], "existing .json file"),
                                         (["generate", "hi", "--regex", "[a-"], "--regex="),
                                         (["generate", "hi", "--regex", "a", "--json-schema", "{}"], "--json-schema"),
                                         (["bench", "serve", "--url", "http://127.0.0.1:9/v1", "--hardware", "local"], "--hardware"),
                                         (["bench", "serve", "--hardware", "no-such-chip"], "no-such-chip"),
                                         (["bench", "serve", "--no-stream"], "--no-stream"),
                                         (["calibrate", "--threads", "0"], "--threads"),
                                         (["calibrate", "--nproc", "1000"], "--nproc"),  # would fork 1,000 ranks
                                         (["generate", "hi", "--top-k", "5"], "--top-k"),  # greedy: was ignored
                                         (["schedule", "1f1b", "--png", "/tmp"], "--png"),  # IsADirectoryError
                                         (["schedule", "1f1b", "--trace", "/proc/x.json"], "--trace"),
                                         # a traceback, a hang or a silent default before (a sweep, 2026-11-27)
                                         (["generate", "hi", "--cache-dir", "/proc/nope"], "--cache-dir"),
                                         (["serve", "--kv-cache-gb", "100000"], "--kv-cache-gb"),  # after the load
                                         (["serve", "--api-key", ""], "--api-key"),  # served with no key
                                         (["generate", "hi", "--top-k", str(2**63), "--temperature", "1"], "top_k"),
                                         (["bench", "serve", "--requests", str(10**20)], "requests"),  # hung
                                         (["bench", "serve", "--rate", "1e-300"], "rate"),  # hung
                                         (["bench", "serve", "--served-name", "x"], "--served-name"),  # ignored
                                         (["primer", "bandwidth", "--nproc", "1"], "--nproc")])  # printed 0 B/s
def test_bad_options_exit_2_with_one_line(capsys, monkeypatch, args, field):
    code, out, err = run(capsys, monkeypatch, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and field in err


def test_serve_names_what_is_wrong_in_a_model_folder(capsys, monkeypatch, tmp_path):
    """The engine process reads the weights: a config.json without the model's shape, or no safetensors beside it, is
    an input error there, reported as one line and exit 2 as in the CLI's own process (not a traceback, exit 1)."""
    from mlsyslab.nn.pretrained import resolve_folder

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((resolve_folder("default") / name).read_bytes())
    for config, field in (({"model_type": "llama", "hidden_size": 64}, "vocab_size"),
                          (json.loads((resolve_folder("default") / "config.json").read_text()), "safetensors")):
        (tmp_path / "config.json").write_text(json.dumps(config))
        code, out, err = run(capsys, monkeypatch, "serve", "--model", str(tmp_path), "--port", "0")
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and field in err, err


def test_serve_on_a_port_in_use_exits_2_before_loading(capsys, monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.perf_counter()
        code, out, err = run(capsys, monkeypatch, "serve", "--port", str(port))
    assert code == 2 and f"--port={port}" in err and "in use" in err and len(err.strip().splitlines()) == 1
    assert time.perf_counter() - started < 5  # the model was not loaded


def test_serve_answers_the_openai_client():
    """`mlsys serve` as deployed: its own process (and the engine's); startup is timed in benchmarks/serve.py. With
    speculative decoding on: the greedy answer is the same, and a reply that copies its prompt keeps drafts. With a
    tool-call parser: tools under OpenAI's default tool_choice ("auto") are served (the model answers in text); with a
    reasoning parser, a reply without a think block is all content. Its
    served name and API key (from MLSYS_API_KEY) are asked for. On --port 0 it takes a free port and says which. The
    server's process never loads torch (its engine's does): it starts the engine's process without waiting on it."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "mlsyslab", "serve", "--port", "0", "--threads", "2",
                                "--kv-cache-gb", "0.2", "--speculative-tokens", "4", "--tool-call-parser", "hermes",
                                "--served-model-name", "smol", "--reasoning-parser", "qwen3"], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "MLSYS_API_KEY": "secret"})
    try:
        banner = next(line for line in process.stderr if line.startswith("serving smol"))  # printed once ready
        url = re.search(r"at (http://127\.0\.0\.1:[1-9][0-9]*)/v1 ", banner).group(1)
        while time.perf_counter() - start < 120:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
        assert "libtorch_cpu" not in Path(f"/proc/{process.pid}/maps").read_text()
        assert any("libtorch_cpu" in Path(f"/proc/{child}/maps").read_text() for child in children)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="secret", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["smol"]
        reply = client.chat.completions.create(model="smol", max_tokens=20, temperature=0,
                                               messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert reply.choices[0].message.content == "The capital of France is Paris."
        assert "reasoning_content" not in (reply.choices[0].message.model_extra or {})  # no think block written
        clock = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
        tooled = client.chat.completions.create(model="default", max_tokens=20, temperature=0, tools=[clock],
                                                messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert tooled.choices[0].message.content == reply.choices[0].message.content
        sentence = "The quick brown fox jumps over the lazy dog near the river bank."
        copied = client.chat.completions.create(model="default", max_tokens=30, temperature=0, messages=[
            {"role": "user", "content": f"Repeat this sentence exactly: {sentence}"}])
        assert copied.choices[0].message.content.startswith("The quick brown fox")
        kept = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith("mlsys_spec_accepted")]
        assert float(kept[0].split()[-1]) > 0, kept
    finally:
        process.terminate()
        process.wait(timeout=20)
