"""The server's Prometheus metrics, in a registry of its own (so that two
servers in one process, as in the tests, do not share counters)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # the *_created series say when a counter was made, which no dashboard here reads

# seconds: a decode step of a tiny model takes ~1 ms, a long prefill seconds
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("kvexport_requests", "HTTP requests answered, by endpoint and status",
                                ["endpoint", "status"], registry=registry)
        self.prompt_tokens = Counter("kvexport_prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.generation_tokens = Counter("kvexport_generation_tokens", "Tokens generated", registry=registry)
        self.cached_tokens = Counter("kvexport_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                     registry=registry)
        self.step_seconds = Histogram("kvexport_step_seconds", "Model time of one engine step (forward and sampling)",
                                      buckets=LATENCY_BUCKETS, registry=registry)
        self.engine_overhead = Histogram("kvexport_engine_overhead_seconds",
                                         "The engine's own time per step: scheduling, detokenizing, stop strings, events",
                                         buckets=LATENCY_BUCKETS, registry=registry)
        self.step_tokens = Histogram("kvexport_step_tokens", "Tokens packed into one step",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=registry)
        self.cells_read = Histogram("kvexport_step_cells_read",
                                    "Cells one step's calls attend over: the step's sessions' cells, not the whole pool",
                                    buckets=(16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768), registry=registry)
        self.ttft = Histogram("kvexport_time_to_first_token_seconds", "From arrival to a choice's first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("kvexport_inter_token_latency_seconds", "Between a choice's consecutive tokens",
                             buckets=LATENCY_BUCKETS, registry=registry)

    def watch(self, name: str, description: str, read: Callable[[], float]) -> None:
        """A gauge read when scraped."""
        Gauge(name, description, registry=self.registry).set_function(read)

    def token_times(self, ttft: float | None, gap: float | None) -> None:
        self.generation_tokens.inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if gap is not None:
            self.itl.observe(gap)

    def step(self, stats) -> None:
        self.step_seconds.observe(stats.model_seconds)
        self.engine_overhead.observe(stats.own_seconds)
        self.step_tokens.observe(stats.tokens)
        self.cells_read.observe(stats.cells_read)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
