"""`mlsys serve` (the OpenAI-compatible server), `mlsys generate` (one prompt, in process) and
`mlsys bench serve` (a load test of ours or any OpenAI-compatible URL).

With `--hardware` (`local` after `mlsys calibrate --nproc 1 --threads N`) the bench prints the TPOT
the twin predicts for this engine (`serve.twin`) beside the measured one.
"""

from __future__ import annotations

import errno
import socket
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from mlsyslab.cli.options import (Json, check_directory, check_greater_than_zero, check_positive, check_range,
                                  check_unused, resolve_assumptions, resolve_hardware)
from mlsyslab.cli.render import emit_json
from mlsyslab.errors import InvalidValue

ModelPath = Annotated[str, typer.Option("--model", "-m", help="default (SmolLM2-135M-Instruct), a .gguf file or an HF folder: Llama, Mistral, Phi-3, Qwen2, Qwen3")]
ServeDtype = Annotated[str, typer.Option("--dtype", help="weights and KV cache: fp32 or bf16")]
Threads = Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads (default: torch's choice)")]
ServeThreads = Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads of the engine process "
                                                     "(default: every core)")]
CacheDir = Annotated[Optional[Path], typer.Option("--cache-dir", help="where converted GGUF models are kept")]
KvCacheGB = Annotated[float, typer.Option("--kv-cache-gb", help="KV cache budget, GB (1e9 bytes)")]
BatchedTokens = Annotated[Optional[int], typer.Option("--max-batched-tokens", help="tokens per step (chunked prefill "
                                                      "budget; default: the engine's, 2048)")]
SpeculativeTokens = Annotated[int, typer.Option("--speculative-tokens", help="n-gram draft tokens a decode verifies per "
                                                "step (speculative decoding by prompt lookup; 0: off)")]


def serve_command(
    model: ModelPath = "default", host: Annotated[str, typer.Option(help="address to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000, dtype: ServeDtype = "fp32", threads: ServeThreads = None,
    kv_cache_gb: KvCacheGB = 1.0, block_size: Annotated[int, typer.Option(help="tokens per KV block")] = 16,
    max_batched_tokens: BatchedTokens = None,
    max_running: Annotated[int, typer.Option(help="requests batched at once")] = 64,
    max_waiting: Annotated[int, typer.Option(help="queue bound; beyond it requests get HTTP 503")] = 256,
    prefix_cache: Annotated[bool, typer.Option("--prefix-cache/--no-prefix-cache", help="reuse shared prompt prefixes")] = True,
    decode_steps: Annotated[Optional[int], typer.Option(
        "--decode-steps", help="decode steps one call may run while nobody waits (multi-step decoding; "
        "1: off; default: the engine's, 8)")] = None,
    speculative_tokens: SpeculativeTokens = 0,
    tool_call_parser: Annotated[Optional[str], typer.Option(
        "--tool-call-parser", help="read the tool calls a model writes under tool_choice \"auto\" (OpenAI's default "
        "with tools) in its family's syntax: hermes (Hermes 2 Pro, SmolLM2/3), llama3_json (Llama 3.1-3.3) or "
        "mistral; default: \"auto\" is refused")] = None,
    reasoning_parser: Annotated[Optional[str], typer.Option(
        "--reasoning-parser", help="return a reasoning model's think block as reasoning_content: deepseek_r1 "
        "(DeepSeek-R1 and its distills: the template opens the block) or qwen3 (Qwen3, QwQ: the model writes it)")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name", help="the name clients ask for (default: the model's; \"default\" is always "
        "accepted)")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key", envvar="MLSYS_API_KEY", help="ask every request for this key (Authorization: Bearer "
        "<key>) but /health and /metrics")] = None,
    cache_dir: CacheDir = None,
):
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /metrics)."""
    start = time.perf_counter()  # "ready in" counts the server's imports too (~0.5 s of FastAPI)
    import uvicorn

    from mlsyslab.serve import reasoning_parser as reasoning
    from mlsyslab.serve.server import build_server
    from mlsyslab.serve.tool_parser import PARSERS

    check_range("--port", port, 0, 65535)
    if tool_call_parser not in (None, *PARSERS):
        raise InvalidValue("--tool-call-parser", tool_call_parser, f"one of {', '.join(PARSERS)}")
    if reasoning_parser not in (None, *reasoning.PARSERS):
        raise InvalidValue("--reasoning-parser", reasoning_parser, f"one of {', '.join(reasoning.PARSERS)}")
    config = engine_config(kv_cache_gb, block_size, max_batched_tokens, max_running, max_waiting, prefix_cache,
                           decode_steps, speculative_tokens)
    if served_model_name is not None and not served_model_name.strip():
        raise InvalidValue("--served-model-name", served_model_name, "a non-empty name")
    if api_key is not None and not api_key.strip():  # an unset $KEY would otherwise serve without one
        raise InvalidValue("--api-key", api_key, "a non-empty key (omit it to serve without one)")
    load_model, load_tokenizer, name = loaders(model, dtype, threads, cache_dir)
    name = served_model_name or name
    listening = bound_socket(host, port)
    with listening:
        app, engine = build_server(load_model, load_tokenizer, name, config, threads or serving_threads(),
                                   tool_call_parser, api_key, reasoning_parser)
        address, bound_port = listening.getsockname()[:2]
        typer.echo(f"serving {name} ({dtype}, {engine.stats.kv_blocks_total} KV blocks of {block_size} tokens) "
                   f"at http://{host if ':' not in address else f'[{address}]'}:{bound_port}/v1 — ready in "
                   f"{time.perf_counter() - start:.1f} s", err=True)
        try:
            uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[listening])
        finally:
            engine.stop()


def bound_socket(host: str, port: int) -> socket.socket:
    """The server's address, taken before the model loads: a host that is not this machine's or a port in use is an
    error naming it at once (exit 2), and port 0 takes a free port, which the banner then prints."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise InvalidValue("--host", host, f"an address or name of this machine ({error.strerror})") from None
    listening = socket.socket(family, kind, protocol)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listening.bind(address)
    except OSError as error:
        listening.close()
        if error.errno == errno.EADDRINUSE:
            raise InvalidValue("--port", port, f"a port nothing listens on at {host} ({error.strerror})") from None
        raise InvalidValue("--host", host, f"an address of this machine ({error.strerror})") from None
    return listening


def generate_command(
    prompt: Annotated[str, typer.Argument(help="the prompt (a user message unless --raw)")],
    model: ModelPath = "default", max_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 128,
    temperature: Annotated[float, typer.Option(help="0: greedy")] = 0.0,
    top_p: Annotated[float, typer.Option(help="nucleus sampling mass")] = 1.0,
    top_k: Annotated[int, typer.Option(help="sample among the k most likely (0 or -1: off)")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="random seed (same seed, same text)")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="complete the text as is, without the chat template")] = False,
    dtype: ServeDtype = "fp32", threads: Threads = None, speculative_tokens: SpeculativeTokens = 0,
    json_schema: Annotated[Optional[str], typer.Option("--json-schema", help="the reply must be JSON matching this "
                                                       "schema (inline JSON, or a .json file)")] = None,
    regex: Annotated[Optional[str], typer.Option("--regex", help="the reply must match this regular expression")] = None,
    cache_dir: CacheDir = None, json: Json = False,
):
    """Generate a reply to one prompt in process, printed as it comes, and say how fast."""
    from mlsyslab.serve.engine import LLM
    from mlsyslab.serve.output import Delta
    from mlsyslab.serve.sampling_params import SamplingParams

    if temperature == 0:
        check_unused("with --temperature > 0 (greedy takes the most likely token)", ("--top-p", top_p, 1.0),
                     ("--top-k", 0 if top_k == -1 else top_k, 0))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            structured_output=structured_output(json_schema, regex))
    loaded, tokenizer, name = load(model, dtype, threads, cache_dir)
    # one sequence's K/V over the model's whole context (and a block): any prompt the model takes fits
    config = loaded.config
    context_bytes = config.kv_elements_per_token * (config.max_seq + 16) * loaded.embed_tokens.weight.element_size()
    llm = LLM(loaded, tokenizer, config=engine_config(context_bytes / 1e9, 16, 512, 1, 1, False,
                                                      speculative_tokens=speculative_tokens), keep_source=False)
    start = time.perf_counter()
    prompt_ids = llm.encode(prompt) if raw else tokenizer.chat_ids([{"role": "user", "content": prompt}])
    try:
        for output in llm.stream(prompt_ids, params):  # the text as it comes, then the finished request
            if not json and isinstance(output, Delta):
                typer.echo(output.text, nl=False)
    except InvalidValue as error:  # the engine compiles the grammar when the request arrives: name our option
        if not error.field.startswith("structured_output"):
            raise
        raise InvalidValue("--regex" if regex is not None else "--json-schema", error.value, error.valid) from None
    elapsed = time.perf_counter() - start
    decode_s = output.latency_s - (output.ttft_s or 0.0)  # the request's own clock: not the chat template's rendering
    result = {"model": name, "text": output.text, "finish_reason": output.finish_reason,
              "prompt_tokens": len(output.prompt_ids), "completion_tokens": len(output.output_ids),
              "seconds": elapsed, "ttft_s": output.ttft_s,
              "decode_tokens_per_s": (len(output.output_ids) - 1) / decode_s if len(output.output_ids) > 1 and decode_s > 0 else None}
    if json:
        emit_json(result)
        return
    typer.echo("")
    rate = f", {result['decode_tokens_per_s']:.1f} tok/s decode" if result["decode_tokens_per_s"] else ""
    typer.echo(f"[{name}: {result['completion_tokens']} tokens in {elapsed:.2f} s, "
               f"TTFT {1000 * (output.ttft_s or 0):.0f} ms{rate}, finish: {output.finish_reason}]", err=True)


def structured_output(json_schema: str | None, regex: str | None):
    """`--json-schema` (inline, or a file) or `--regex` as the engine's StructuredOutput (`serve.grammar`)."""
    import json

    from mlsyslab.serve.grammar import StructuredOutput

    if json_schema is not None and regex is not None:
        raise InvalidValue("--json-schema", json_schema[:40], "not beside --regex (one grammar per reply)")
    if regex is not None:
        return StructuredOutput("regex", regex)
    if json_schema is None:
        return None
    if json_schema.endswith(".json") and not Path(json_schema).is_file():
        raise InvalidValue("--json-schema", json_schema, "inline JSON, or the path of an existing .json file")
    text = Path(json_schema).read_text() if json_schema.endswith(".json") else json_schema
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidValue("--json-schema", json_schema[:40], f"a JSON schema, inline or in a .json file ({error})") from None
    if not isinstance(schema, dict):
        raise InvalidValue("--json-schema", json_schema[:40], "a JSON object (a schema)")
    return StructuredOutput("json", json.dumps(schema))


def serving_threads() -> int:
    """Every core for the engine process. Measured here (2 cores, bf16, 128-token prompts, 64 output
    tokens, the engine in its own process): 2 threads served 48 tok/s at 1 request and 317 at 16 in
    flight, 1 thread 48 and 231."""
    import os

    return os.cpu_count() or 1


def engine_config(kv_cache_gb, block_size, max_batched_tokens, max_running, max_waiting, prefix_cache,
                  decode_steps=None, speculative_tokens=0):
    from mlsyslab.serve.config import EngineConfig

    if max_batched_tokens is None:
        max_batched_tokens = EngineConfig.max_batched_tokens
    if decode_steps is None:
        decode_steps = EngineConfig.decode_steps
    check_positive(block_size=block_size, max_batched_tokens=max_batched_tokens, max_running=max_running,
                   max_waiting=max_waiting, decode_steps=decode_steps)
    check_greater_than_zero(kv_cache_gb=kv_cache_gb)
    from mlsyslab.measure.host import machine_memory_bytes

    memory = machine_memory_bytes()
    if memory and kv_cache_gb * 1e9 > memory:
        raise InvalidValue("--kv-cache-gb", kv_cache_gb, f"at most this machine's memory, {memory / 1e9:.1f} GB")
    if speculative_tokens < 0:
        raise InvalidValue("--speculative-tokens", speculative_tokens, ">= 0 (0: off)")
    return EngineConfig(kv_cache_bytes=int(kv_cache_gb * 1e9), block_size=block_size,
                        max_batched_tokens=max_batched_tokens, max_running=max_running, max_waiting=max_waiting,
                        prefix_cache=prefix_cache, decode_steps=decode_steps, speculative_tokens=speculative_tokens)


def loaders(model: str, dtype: str, threads: int | None, cache_dir: Path | None):
    """Validate the options, then (model loader, tokenizer loader, name) (`nn.pretrained.loaders`; no torch
    imported: `mlsys serve` hands them to its engine's process)."""
    if dtype not in ("fp32", "bf16"):
        raise InvalidValue("--dtype", dtype, "fp32, bf16")
    check_positive(threads=threads)
    check_directory("--cache-dir", cache_dir)
    from mlsyslab.nn import pretrained

    return pretrained.loaders(model, dtype, cache_dir)


def load(model: str, dtype: str, threads: int | None, cache_dir: Path | None):
    """`loaders`, loaded in this process on `threads` threads: (model, tokenizer, name)."""
    load_model, load_tokenizer, name = loaders(model, dtype, threads, cache_dir)
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return load_model(), load_tokenizer(), name


def bench_serve_command(
    url: Annotated[Optional[str], typer.Option(help="an OpenAI-compatible base URL (…/v1); default: start ours in process")] = None,
    stream: Annotated[bool, typer.Option("--stream/--no-stream", help="streamed completions (--no-stream: whole ones, "
                                         "for a --url that cannot stream; no TTFT or TPOT then)")] = True,
    model: ModelPath = "default", served_name: Annotated[Optional[str], typer.Option(help="model name sent in requests (default with --url: the first the server lists)")] = None,
    requests: Annotated[int, typer.Option(help="requests in the run")] = 64,
    concurrency: Annotated[int, typer.Option(help="requests in flight (closed loop)")] = 16,
    rate: Annotated[float, typer.Option(help="Poisson arrivals per second (open loop; 0: closed loop)")] = 0.0,
    prompt_tokens: Annotated[int, typer.Option(help="mean prompt length, tokens")] = 128,
    prompt_spread: Annotated[float, typer.Option(help="prompt lengths uniform in mean·[1-s, 1+s]")] = 0.0,
    output_tokens: Annotated[int, typer.Option(help="mean output length, tokens")] = 64,
    output_spread: Annotated[float, typer.Option(help="output lengths uniform in mean·[1-s, 1+s]")] = 0.0,
    shared_prefix: Annotated[float, typer.Option(help="fraction of every prompt shared by all requests")] = 0.0,
    prefix_ablation: Annotated[bool, typer.Option("--prefix-ablation", help="also run with the prefix cache off and print the ratios")] = False,
    seed: Annotated[int, typer.Option(help="workload seed")] = 0,
    dtype: ServeDtype = "fp32", threads: ServeThreads = None, kv_cache_gb: KvCacheGB = 1.0,
    max_batched_tokens: BatchedTokens = None, cache_dir: CacheDir = None, json: Json = False,
    hardware: Annotated[Optional[str], typer.Option("--hardware", help="also predict the TPOT on this hardware "
                                                    "(local: after `mlsys calibrate --nproc 1 --threads N`)")] = None,
):
    """Load-test a server: throughput, TTFT and TPOT p50/p99 (ours in process unless --url)."""
    from mlsyslab.serve.loadgen import Workload, run_benchmark

    workload = Workload(requests=requests, concurrency=concurrency, rate=rate, prompt_tokens=prompt_tokens,
                        prompt_spread=prompt_spread, output_tokens=output_tokens, output_spread=output_spread,
                        shared_prefix=shared_prefix, seed=seed)
    if url is None and not stream:
        raise InvalidValue("--no-stream", True, "only with --url (our server streams)")
    if url is not None and hardware is not None:
        raise InvalidValue("--hardware", hardware, "only without --url (the prediction is of this engine)")
    if url is None and served_name is not None:
        raise InvalidValue("--served-name", served_name, "only with --url (it picks the model the server at the URL serves)")
    if url is not None:
        check_unused("only without --url (it configures the engine we start; --served-name picks the model at the URL)",
                     ("--model", model, "default"), ("--dtype", dtype, "fp32"), ("--threads", threads, None),
                     ("--kv-cache-gb", kv_cache_gb, 1.0), ("--max-batched-tokens", max_batched_tokens, None),
                     ("--cache-dir", cache_dir, None))
    twin = None
    if hardware is not None:
        from mlsyslab.serve.config import compute_dtype
        from mlsyslab.serve.twin import check_calibration

        twin = resolve_hardware(hardware, None, compute_dtype(hardware, dtype))
        if hardware == "local":
            check_calibration(twin[0])
    if url is not None:
        if prefix_ablation:
            raise InvalidValue("--prefix-ablation", True, "only without --url (it restarts our own server)")
        served, context = model_at(url, served_name)
        if context is not None:
            workload.check_fits(context, "the server's")
        reports = {"server": run_benchmark(url, served, workload, stream=stream).to_dict()}
    else:
        loaded, tokenizer, name = load(model, dtype, threads, cache_dir)
        workload.check_fits(loaded.config.max_seq, "the model's")
        reports = {}
        for cache_on in ([True, False] if prefix_ablation else [True]):
            config = engine_config(kv_cache_gb, 16, max_batched_tokens, 64, max(256, requests), cache_on)
            reports["prefix cache on" if cache_on else "prefix cache off"] = bench_in_process(
                loaded, tokenizer, name, config, workload, threads or serving_threads())
    if twin is not None:
        from mlsyslab.serve.twin import predicted_tpot

        hw, measured = twin
        tpot = predicted_tpot(loaded, name, hw, resolve_assumptions(None, measured), concurrency, prompt_tokens,
                              output_tokens)
        for report in reports.values():
            report["predicted_tpot_s"] = tpot
    if prefix_ablation:
        on, off = reports["prefix cache on"], reports["prefix cache off"]
        reports["prefix cache on/off"] = {"prefill_tokens": on["prefill_tokens"] / off["prefill_tokens"],
                                          "ttft_p50": on["ttft_p50_s"] / off["ttft_p50_s"]}
    if json:
        emit_json(reports)
    else:
        print_reports(reports)
    if any(report.get("failed") for report in reports.values()):
        raise typer.Exit(1)  # requests failed: the errors are in the report


def model_at(url: str, served_name: str | None) -> tuple[str, int | None]:
    """The model name to send to the server at `url` — --served-name, checked against the server's list, or the
    first model it lists — and its context length if the server gives it."""
    from mlsyslab.serve.loadgen import served_models

    models = served_models(url)
    if served_name is None:
        if not models:
            raise InvalidValue("--url", url, "a server that lists a model under GET /models")
        served_name = next(iter(models))
    if served_name not in models:
        raise InvalidValue("--served-name", served_name, f"a model the server lists: {', '.join(models) or 'none'}")
    return served_name, models[served_name]


def bench_in_process(model, tokenizer, name, config, workload, threads: int) -> dict:
    """Start our server on a free local port, run the workload, add the engine's own counters."""
    from mlsyslab.serve.loadgen import run_benchmark
    from mlsyslab.serve.server import ServerThread, build_server

    app, engine = build_server(model, tokenizer, name, config, threads)
    try:
        with ServerThread(app) as base:
            report = run_benchmark(base + "/v1", name, workload).to_dict()
        stats = engine.check()
    finally:
        engine.stop()
    report.update(prefill_tokens=stats.prefill_tokens, decode_tokens=stats.decode_tokens, steps=stats.steps,
                  preemptions=stats.preemptions, prefix_hit_rate=stats.prefix_hit_rate)
    return report


def print_reports(reports: dict) -> None:
    for label, report in reports.items():
        if label == "prefix cache on/off":
            typer.echo(f"prefix cache on/off: prefill tokens x{report['prefill_tokens']:.2f}, TTFT p50 x{report['ttft_p50']:.2f}")
            continue
        typer.echo(f"{label}: {report['completed']} requests ({report['failed']} failed) in {report['duration_s']:.1f} s — "
                   f"{report['output_tokens_per_s']:.1f} output tok/s, {report['requests_per_s']:.2f} req/s")
        typer.echo(f"  TTFT p50 {ms(report['ttft_p50_s'], 0)}, p99 {ms(report['ttft_p99_s'], 0)}; "
                   f"TPOT p50 {ms(report['tpot_p50_s'], 1)}, p99 {ms(report['tpot_p99_s'], 1)}")
        if "predicted_tpot_s" in report:
            typer.echo(f"  TPOT predicted {1000 * report['predicted_tpot_s']:.1f} ms (decode step at {report['workload']['concurrency']} "
                       f"in flight), measured p50 / predicted = {report['tpot_p50_s'] / report['predicted_tpot_s']:.2f}")
        if "prefill_tokens" in report:
            typer.echo(f"  engine: {report['prefill_tokens']} prefill + {report['decode_tokens']} decode tokens in "
                       f"{report['steps']} steps, prefix hit rate {report['prefix_hit_rate']:.2f}, "
                       f"{report['preemptions']} preemptions")
        if not report["trustworthy"]:
            typer.echo(f"  warning: other processes kept {report['busy_cores_before']:.1f} of {report['cores']} cores busy "
                       "before the run; these numbers are not trustworthy")
        for error in report["errors"]:
            typer.echo(f"  error: {error}", err=True)


def ms(seconds: float | None, digits: int) -> str:
    """Milliseconds, or "n/a" where nothing was measured (no request finished; TPOT of one-token outputs)."""
    import math

    return "n/a" if seconds is None or math.isnan(seconds) else f"{1000 * seconds:.{digits}f} ms"
