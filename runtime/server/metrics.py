"""Prometheus metrics of one server (its own registry, so several apps may live in one process)."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dflash_requests", "HTTP generation requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("dflash_finished_requests", "Generations by finish reason "
                                "(stop, length, error, cancelled: client disconnected)", ["reason"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("dflash_generated_tokens", "Tokens generated (streamed to clients)", registry=r)
        self.rounds = Counter("dflash_rounds", "Speculative rounds (draft + verify) of finished requests", registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Admission to first token, per request",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tau = Histogram("dflash_acceptance_length", "Mean tokens committed per round (tau), per request",
                             buckets=TAU_BUCKETS, registry=r)
        self.acceptance = Gauge("dflash_acceptance_per_position", "Fraction of rounds whose draft at this block "
                                "position was accepted (mean over finished requests)", ["position"], registry=r)
        self.running = Gauge("dflash_running_requests", "Requests generating now", registry=r)
        self.batch = Histogram("dflash_batch_size", "Mean requests sharing each forward over a request's rounds, "
                               "per request", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.queued = Gauge("dflash_queue_depth", "Requests waiting for a generation slot", registry=r)
        self.engine_live = Gauge("dflash_engine_live_requests", "Requests holding state in the engine's actors "
                                 "(engine.snapshot(), at scrape time)", registry=r)
        self.engine_cache = Gauge("dflash_engine_cache_bytes", "Device KV/context cache bytes held by the engine",
                                  registry=r)
        self._position_sums: list[float] = []
        self._position_counts: list[int] = []

    def observe_finish(self, reason: str, stats: dict) -> None:
        self.finished.labels(reason).inc()
        rounds = int(stats.get("rounds", 0) or 0)
        if rounds:
            self.rounds.inc(rounds)
            self.tau.observe(float(stats.get("tau", 0.0)))
            self.batch.observe(float(stats.get("mean_batch_size", 1.0)))
            for k, value in enumerate(stats.get("acceptance_per_position", []) or []):
                while len(self._position_sums) <= k:
                    self._position_sums.append(0.0)
                    self._position_counts.append(0)
                self._position_sums[k] += float(value)
                self._position_counts[k] += 1
                self.acceptance.labels(str(k + 1)).set(self._position_sums[k] / self._position_counts[k])

    def render(self) -> bytes:
        return generate_latest(self.registry)
