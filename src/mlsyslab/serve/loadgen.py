"""A load generator for any OpenAI-compatible server: throughput, TTFT and TPOT percentiles.

Requests are streamed `/v1/completions` calls whose prompts are token-id lists (the API accepts
them; no tokenizer is needed on this side; servers that take only text get the ids decoded) of a
chosen length distribution; a `shared_prefix`
fraction of every prompt is the same tokens (a shared system prompt), which a prefix cache can
reuse. Outputs run to exactly `max_tokens` (`ignore_eos`). Load is closed-loop (`concurrency`
requests in flight) or open-loop (Poisson arrivals at `rate` requests/s).

Measured per request: TTFT (send to first streamed token), TPOT ((end - first token) / (tokens - 1)),
end-to-end latency; overall: output tokens/s and requests/s over the run's wall time. The run first
measures how many cores other processes keep busy; numbers taken on a busy machine are flagged.
Used by `mlsys bench serve` and benchmarks/serve.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from mlsyslab.errors import InvalidValue


MAX_REQUESTS = 1_000_000  # the workload is drawn up front: beyond this, minutes before the first request
MIN_RATE = 1e-3  # arrivals per second: one every ~17 minutes


@dataclass(frozen=True)
class Workload:
    requests: int = 64
    concurrency: int = 16  # closed loop: requests in flight (ignored when rate > 0)
    rate: float = 0.0  # open loop: Poisson arrivals per second (0: closed loop)
    prompt_tokens: int = 128
    prompt_spread: float = 0.0  # prompt lengths uniform in prompt_tokens · [1 - spread, 1 + spread]
    output_tokens: int = 64
    output_spread: float = 0.0
    shared_prefix: float = 0.0  # fraction of each prompt that is the same for every request
    vocab_low: int = 1000  # prompt ids drawn from [vocab_low, vocab_high): ordinary tokens
    vocab_high: int = 20000
    seed: int = 0

    def __post_init__(self):
        for name, ok, valid in (("requests", 1 <= self.requests <= MAX_REQUESTS, f"in 1..{MAX_REQUESTS:,}"),
                                ("concurrency", self.concurrency >= 1, ">= 1"),
                                ("rate", self.rate == 0 or self.rate >= MIN_RATE, f"0 (closed loop) or >= {MIN_RATE} "
                                 "requests per second"),
                                ("prompt_tokens", self.prompt_tokens >= 1, ">= 1"),
                                ("output_tokens", self.output_tokens >= 1, ">= 1"),
                                ("prompt_spread", 0 <= self.prompt_spread < 1, "in [0, 1)"),
                                ("output_spread", 0 <= self.output_spread < 1, "in [0, 1)"),
                                ("shared_prefix", 0 <= self.shared_prefix <= 1, "in [0, 1]")):
            if not ok:
                raise InvalidValue(name, getattr(self, name), valid)

    def longest(self) -> int:
        """Prompt and output tokens of the longest request the workload can draw."""
        return (round(self.prompt_tokens * (1 + self.prompt_spread)) + round(self.output_tokens * (1 + self.output_spread)))

    def check_fits(self, context: int, whose: str) -> None:
        """Refuse, before any load is sent, a workload whose longest request would not fit `context` tokens."""
        if self.longest() > context:
            raise InvalidValue("--prompt-tokens", self.prompt_tokens, f"prompt + output tokens of the longest request "
                               f"({self.longest()}, spreads included) at most {whose} context, {context}")

    def prompts(self) -> list[tuple[list[int], int]]:
        """(prompt ids, max_tokens) for every request, reproducible from the seed."""
        rng = random.Random(self.seed)
        prefix = [rng.randrange(self.vocab_low, self.vocab_high) for _ in range(round(self.prompt_tokens * self.shared_prefix))]
        out = []
        for _ in range(self.requests):
            length = max(1, round(self.prompt_tokens * rng.uniform(1 - self.prompt_spread, 1 + self.prompt_spread)))
            shared = prefix[:length]
            ids = shared + [rng.randrange(self.vocab_low, self.vocab_high) for _ in range(length - len(shared))]
            new = max(1, round(self.output_tokens * rng.uniform(1 - self.output_spread, 1 + self.output_spread)))
            out.append((ids, new))
        return out


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float | None = 0.0  # None: not streamed, so the first token's time is unknown
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass
class BenchReport:
    url: str
    workload: dict
    completed: int
    failed: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    latency_p50_s: float
    latency_p99_s: float
    busy_cores_before: float  # cores other processes kept busy just before the run
    cores: int
    trustworthy: bool
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def served_models(url: str, timeout_s: float = 10.0) -> dict[str, int | None]:
    """The models the OpenAI-compatible server at `url` (ending in /v1) lists under GET /models, each id with its
    context length where the server gives it (vLLM's and ours: `max_model_len`), else None; an InvalidValue naming
    --url when nothing answers there as such a server, before any load is sent."""
    import httpx

    base = url.rstrip("/")
    valid = "the base URL of a running OpenAI-compatible server, ending in /v1"
    try:
        response = httpx.get(base + "/models", timeout=timeout_s)
        response.raise_for_status()
        return {entry["id"]: entry.get("max_model_len") for entry in response.json()["data"]}
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise InvalidValue("--url", url, valid, f"GET {base}/models: {type(error).__name__}: {error}"[:300]) from None
    except (ValueError, KeyError, TypeError) as error:  # not JSON, or not the API's {"data": [{"id": ...}]}
        raise InvalidValue("--url", url, valid, f"GET {base}/models did not return a model list ({error!r})"[:300]) from None


def run_benchmark(url: str, model: str, workload: Workload, timeout_s: float = 600.0, as_text=None,
                  stream: bool = True) -> BenchReport:
    """Run `workload` against the OpenAI-compatible server at `url` (ending in /v1). `as_text` (token
    ids -> str, a tokenizer's decode) sends prompts as text, for servers that take no token ids;
    `stream=False` asks for whole completions (no TTFT or TPOT then), for servers that cannot stream."""
    busy = other_processes_busy_cores()
    cores = os.cpu_count() or 1
    results, duration = asyncio.run(drive(url.rstrip("/"), model, workload, timeout_s, as_text, stream))
    good = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in good)

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    tpot = [r.tpot_s for r in good if r.tpot_s is not None]
    latency = [r.latency_s for r in good]
    return BenchReport(
        url=url, workload=asdict(workload), completed=len(good), failed=len(results) - len(good), duration_s=duration,
        output_tokens_per_s=tokens / duration, requests_per_s=len(good) / duration,
        ttft_p50_s=pct(ttft, 50), ttft_p99_s=pct(ttft, 99), tpot_p50_s=pct(tpot, 50), tpot_p99_s=pct(tpot, 99),
        latency_p50_s=pct(latency, 50), latency_p99_s=pct(latency, 99), busy_cores_before=busy, cores=cores,
        trustworthy=busy < 0.25 * cores, errors=sorted({r.error for r in results if not r.ok})[:5])


def other_processes_busy_cores(window_s: float = 1.0) -> float:
    """Cores kept busy by other processes over `window_s` (all CPU time in /proc/stat minus this process's)."""
    def sample():
        with open("/proc/stat") as stat:
            fields = [int(x) for x in stat.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        own = os.times()
        return sum(fields) - idle, own.user + own.system
    try:
        busy0, own0 = sample()
        time.sleep(window_s)
        busy1, own1 = sample()
    except OSError:  # not Linux: fall back to the load average
        return os.getloadavg()[0]
    ticks = os.sysconf("SC_CLK_TCK")
    return max(0.0, (busy1 - busy0) / ticks - (own1 - own0)) / window_s


async def drive(url: str, model: str, workload: Workload, timeout_s: float, as_text=None, stream: bool = True
                ) -> tuple[list[RequestResult], float]:
    import httpx

    prompts = [(as_text(ids) if as_text else ids, new) for ids, new in workload.prompts()]
    limits = httpx.Limits(max_connections=max(workload.concurrency, 64), max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        if workload.rate > 0:
            rng = random.Random(workload.seed + 1)
            tasks, delay = [], 0.0
            for prompt, new in prompts:
                tasks.append(asyncio.create_task(after(delay, one(client, url, model, prompt, new, stream))))
                delay += rng.expovariate(workload.rate)
            results = await asyncio.gather(*tasks)
        else:
            queue = list(reversed(prompts))
            results = []

            async def worker():
                while queue:
                    prompt, new = queue.pop()
                    results.append(await one(client, url, model, prompt, new, stream))

            await asyncio.gather(*(worker() for _ in range(min(workload.concurrency, len(prompts)))))
        return list(results), time.perf_counter() - start


async def whole(client, url: str, body: dict, start: float) -> RequestResult:
    """One completion returned whole: its latency, and its tokens from the usage report."""
    try:
        response = await client.post(url + "/completions", json=body)
        if response.status_code != 200:
            return RequestResult(False, error=f"HTTP {response.status_code}: {response.text[:200]}")
        tokens = response.json()["usage"]["completion_tokens"]
    except Exception as error:  # noqa: BLE001 - a failed request is a result, not a crash of the benchmark
        return RequestResult(False, error=f"{type(error).__name__}: {error}"[:200])
    return RequestResult(True, None, time.perf_counter() - start, tokens)


async def after(delay_s: float, coroutine):
    await asyncio.sleep(delay_s)
    return await coroutine


async def one(client, url: str, model: str, prompt: list[int] | str, max_tokens: int, stream: bool = True
              ) -> RequestResult:
    """One completion, streamed unless `stream` is False; tokens counted from the usage report when sent."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True, **({"stream_options": {"include_usage": True}} if stream else {})}
    start = time.perf_counter()
    if not stream:
        return await whole(client, url, body, start)
    first, chunks, usage_tokens = None, 0, None
    try:
        async with client.stream("POST", url + "/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                payload = json.loads(line[5:])
                if payload.get("usage"):
                    usage_tokens = payload["usage"].get("completion_tokens")
                if payload.get("choices") and payload["choices"][0].get("text"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
    except Exception as error:  # noqa: BLE001 - a failed request is a result, not a crash of the benchmark
        return RequestResult(False, error=f"{type(error).__name__}: {error}"[:200])
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, error="no tokens streamed")
    return RequestResult(True, first - start, end - start, usage_tokens or chunks)
