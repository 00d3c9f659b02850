"""Prometheus metrics of one server (its own registry, so several apps may live in one process).

Two families: ``dflash_*`` (this runtime's own: tau, batch sizes, acceptance per position as a
fraction) and the names vLLM exports (``vllm:num_requests_running``, ``vllm:time_to_first_token_seconds``,
``vllm:spec_decode_num_accepted_tokens_total`` ...; label ``model_name``), so that dashboards and
autoscalers written for vLLM read this server unchanged.
"""

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
# vLLM's buckets for the same histograms
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0)


class VLLMMetrics:
    """The series vLLM's engine exports, under its names, for one model."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, label = registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests generating now", label, registry=r).labels(model_name)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for a slot", label, registry=r).labels(model_name)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests", label,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", label, registry=r).labels(model_name)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Admission to first token", label,
                              buckets=VLLM_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens (a round's tokens share its gap)",
                             label, buckets=VLLM_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Admission to the last token", label,
                             buckets=VLLM_E2E_BUCKETS, registry=r).labels(model_name)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Speculative rounds (one block drafted each)", label,
                              registry=r).labels(model_name)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", label,
                                    registry=r).labels(model_name)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", label,
                                       registry=r).labels(model_name)
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each block position", ["model_name", "position"],
                                        registry=r)
        self.model_name = model_name

    def observe_rounds(self, rounds: int, acceptance_per_position: list[float]) -> None:
        """A finished request's rounds: the fraction of rounds whose draft at each position was accepted."""
        self.drafts.inc(rounds)
        self.draft_tokens.inc(rounds * len(acceptance_per_position))
        for k, fraction in enumerate(acceptance_per_position):
            accepted = round(fraction * rounds)
            self.accepted_tokens.inc(accepted)
            self.accepted_per_pos.labels(self.model_name, str(k)).inc(accepted)


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = r = CollectorRegistry()
        self.vllm = VLLMMetrics(r, model_name)
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

    def set_running(self, n: int) -> None:
        self.running.set(n)
        self.vllm.running.set(n)

    def set_queued(self, n: int) -> None:
        self.queued.set(n)
        self.vllm.waiting.set(n)

    def observe_prompt(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)
        self.vllm.prompt_tokens.inc(tokens)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm.ttft.observe(seconds)

    def observe_tokens(self, tokens: int, gap_s: float | None) -> None:
        """``tokens`` streamed together, ``gap_s`` after the previous ones (None: the first)."""
        self.generated_tokens.inc(tokens)
        self.vllm.generation_tokens.inc(tokens)
        for _ in range(tokens if gap_s is not None else 0):
            self.vllm.itl.observe(gap_s / tokens)

    def observe_finish(self, reason: str, stats: dict, e2e_s: float | None = None) -> None:
        self.finished.labels(reason).inc()
        if e2e_s is not None:
            self.vllm.e2e.observe(e2e_s)
        rounds = int(stats.get("rounds", 0) or 0)
        if rounds:
            self.vllm.observe_rounds(rounds, [float(x) for x in stats.get("acceptance_per_position", []) or []])
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
