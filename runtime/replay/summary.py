"""What a run did, from its round records: acceptance, stage times, GPU idle, speculation."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

from protocol import RoundRecord
from runtime.stopping import delivered_tokens

from .reading import RequestLog, RoundWindow


@dataclass(frozen=True)
class Stage:
    """One stage of a round, between two of its record's timestamps (perf_counter seconds)."""

    label: str
    name: str  # of its slices in a trace
    actor: str  # whose track the trace draws it on
    start: str
    end: str

    def seconds(self, record: RoundRecord) -> float:
        return getattr(record, self.end) - getattr(record, self.start)


STAGES = (
    Stage("drafted -> verify queued", "draft", "drafter", "draft_queued", "verify_queued"),
    Stage("verify queued -> ready", "verify", "verifier", "verify_queued", "verify_ready"),
    Stage("ready -> committed", "commit", "committer", "verify_ready", "commit"),
)


@dataclass
class Summary:
    requests: int
    rounds: int
    tokens: int  # streamed
    finish_reasons: dict[str, int]
    tau_histogram: dict[int, int]  # tau = accepted + 1 -> rounds
    tau_mean: float  # tokens a round delivered (up to max_tokens), as the engine reports tau
    acceptance_per_position: list[float]  # k = 1, 2...: rounds accepting >= k drafts / rounds that drafted >= k
    stage_ms: dict[str, dict[str, float]]  # stage label -> mean, p50, p90, max
    gpu_idle_ms: dict[str, float]  # total, mean, max over the gaps between consecutive rounds, and their count
    speculative_rounds: int
    discarded_rounds: int | None  # None: a finish record that does not log it


def idle_after(log: RequestLog) -> dict[int, float]:
    """Round -> GPU idle after it (every round but the last), as the committer measures it:
    from reading the round's verify to the next round's drafts being queued (0 if queued first)."""
    return {a.round: max(0.0, b.draft_queued - a.verify_ready) for a, b in zip(log.rounds, log.rounds[1:])}


def delivered(log: RequestLog) -> dict[int, int]:
    """Round -> its committed tokens up to max_tokens, as the committer counts them for tau
    (a last round drafts its whole block and may commit past max_tokens; the first token is the prefill's)."""
    remaining = log.request.params.max_tokens - 1 if log.request is not None else sys.maxsize  # no record: no cap
    counts: dict[int, int] = {}
    for r in log.rounds:
        counts[r.round] = delivered_tokens(len(r.committed), remaining)
        remaining -= counts[r.round]
    return counts


def _stats_ms(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "max": 0.0}
    ms = sorted(s * 1e3 for s in seconds)
    at = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]  # noqa: E731  (nearest rank)
    return {"mean": sum(ms) / len(ms), "p50": at(0.5), "p90": at(0.9), "max": ms[-1]}


def summarize(logs: list[RequestLog], window: RoundWindow) -> Summary:
    rounds = [r for log in logs for r in window.of(log)]
    tokens: list[int] = []  # each round's delivered tokens, counted once per request
    for log in logs:
        counts = delivered(log)
        tokens += [counts[r.round] for r in window.of(log)]
    gaps = [gap for log in logs for r, gap in idle_after(log).items() if r in window]
    finishes = [log.finish for log in logs if log.finish is not None]
    longest = max((r.block_size - 1 for r in rounds), default=0)
    drafted = [sum(r.block_size - 1 >= k for r in rounds) for k in range(1, longest + 1)]
    reached = [sum(r.accepted >= k for r in rounds) for k in range(1, longest + 1)]
    discarded = [f.discarded_rounds for f in finishes if f.discarded_rounds is not None]
    return Summary(
        requests=len(logs), rounds=len(rounds), tokens=sum(len(f.token_ids) for f in finishes),
        finish_reasons=dict(Counter(f.finish_reason for f in finishes)),
        tau_histogram=dict(sorted(Counter(r.accepted + 1 for r in rounds).items())),
        tau_mean=sum(tokens) / len(rounds) if rounds else 0.0,
        acceptance_per_position=[a / d for a, d in zip(reached, drafted)],
        stage_ms={s.label: _stats_ms([s.seconds(r) for r in rounds]) for s in STAGES},
        gpu_idle_ms={**_stats_ms(gaps), "total": sum(gaps) * 1e3, "gaps": len(gaps)},
        speculative_rounds=sum(r.speculative for r in rounds),
        discarded_rounds=sum(discarded) if finishes and len(discarded) == len(finishes) else None,
    )


def round_rows(log: RequestLog, window: RoundWindow) -> list[dict[str, object]]:
    """One row per round of one request, for a round-by-round listing."""
    idle = idle_after(log)
    return [{"round": r.round, "block": r.block_size, "accepted": r.accepted, "speculative": r.speculative,
             "drafts": r.drafts, "target_tokens": r.target_tokens, "committed": r.committed,
             "stage_ms": {s.label: s.seconds(r) * 1e3 for s in STAGES},
             "idle_after_ms": idle[r.round] * 1e3 if r.round in idle else None} for r in window.of(log)]
