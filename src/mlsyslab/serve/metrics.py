"""Prometheus metrics of a serving engine: queue depth, running requests, KV blocks, prefix hits,
TTFT and TPOT histograms, token and request counters. Gauges read the engine when scraped."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from mlsyslab.serve.engine_process import EngineStats
from mlsyslab.serve.output import RequestOutput

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60)


class EngineMetrics:
    """One registry per server, so two servers in a process (tests) never share series."""

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.stats, self.up = EngineStats, lambda: True
        gauges = (("mlsys_requests_waiting", "requests in the queue", "waiting"),
                  ("mlsys_requests_running", "requests holding KV blocks", "running"),
                  ("mlsys_kv_blocks_used", "KV blocks in use (requests and prefix cache)", "kv_blocks_used"),
                  ("mlsys_kv_blocks_prefix_cache", "KV blocks the prefix cache holds (in kv_blocks_used too; evicted when "
                   "needed once no request shares them): idle, used = these, else a block leaked", "prefix_cache_blocks"),
                  ("mlsys_kv_blocks_total", "KV blocks in the pool", "kv_blocks_total"),
                  ("mlsys_prefix_cache_hit_rate", "prompt tokens found in the prefix cache / looked up", "prefix_hit_rate"),
                  ("mlsys_preemptions", "requests preempted so far", "preemptions"),
                  ("mlsys_spec_draft_tokens", "speculative draft tokens verified so far", "draft_tokens"),
                  ("mlsys_spec_accepted_tokens", "speculative draft tokens kept so far", "accepted_draft_tokens"))
        for name, help_text, field in gauges:
            Gauge(name, help_text, registry=registry).set_function(lambda field=field: getattr(self.stats(), field))
        Gauge("mlsys_engine_up", "1 while the engine runs; 0 once it has failed (the gauges above then keep its last "
              "numbers, and every request gets a 503)", registry=registry).set_function(lambda: float(self.up()))
        self.ttft = Histogram("mlsys_time_to_first_token_seconds", "arrival to first token", buckets=LATENCY_BUCKETS_S, registry=registry)
        self.tpot = Histogram("mlsys_time_per_output_token_seconds", "mean time between output tokens of a request",
                              buckets=LATENCY_BUCKETS_S, registry=registry)
        self.prompt_tokens = Counter("mlsys_prompt_tokens", "prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("mlsys_generation_tokens", "tokens generated", registry=registry)
        self.requests = Counter("mlsys_requests_finished", "finished requests by reason", ["finish_reason"], registry=registry)

    def watch(self, stats, up) -> None:
        """Read the gauges from `stats()` (the engine's latest `EngineStats`) and `up()` when scraped."""
        self.stats, self.up = stats, up

    def observe(self, output: RequestOutput) -> None:
        """Record a finished request (called from the engine process's reader thread)."""
        self.requests.labels(output.finish_reason).inc()
        self.prompt_tokens.inc(len(output.prompt_ids))
        self.generation_tokens.inc(len(output.output_ids))
        if output.ttft_s is not None:
            self.ttft.observe(output.ttft_s)
            if len(output.output_ids) > 1:
                self.tpot.observe((output.latency_s - output.ttft_s) / (len(output.output_ids) - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
