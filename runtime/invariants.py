"""The decode-loop invariants (docs/decode-loop.md, "Invariants"), checked on every round's record.

These are real checks, not ``assert``s: they hold under ``python -O`` and each violation
raises its own named error carrying the round's state, so a log or a test can say
exactly which invariant broke, where.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import RuntimeErrorBase


class InvariantError(RuntimeErrorBase):
    invariant = "invariant"

    def __init__(self, message: str, facts: RoundFacts) -> None:
        state = asdict(facts)  # only when a round fails: auditing a good round builds no dict
        super().__init__(f"{self.invariant} invariant violated: {message} (round state: {state})")
        self.detail, self.state = message, state


class LagViolation(InvariantError):
    invariant = "lag"


class TrimViolation(InvariantError):
    invariant = "trim"


class RollbackViolation(InvariantError):
    invariant = "no-rollback"


class LayoutViolation(InvariantError):
    invariant = "layout"


class AcceptanceViolation(InvariantError):
    invariant = "accepted-prefix"


@dataclass
class RoundFacts:
    """What the host knows of one finished round: enough to check every invariant."""

    round: int
    anchor_pos: int
    block_size: int
    drafts: list[int]
    target_tokens: list[int]
    accepted: int
    committed: list[int]
    committed_before: int  # prompt + generated tokens before this round
    target_kv_before: int
    target_kv_after: int
    drafter_ctx_before: int
    drafter_ctx_after: int
    new_ctx_rows: int
    tap_shape: tuple[int, ...]
    greedy: bool = True
    branch: int = 0  # which of the blocks the round verified it kept (runtime/branches.py)
    extra: dict[str, Any] = field(default_factory=dict)


# every RoundFacts field is a RoundRecord field of the same name, except what the auditor counts
RECORDED_FACTS = tuple(f.name for f in fields(RoundFacts) if f.name not in ("committed_before", "extra"))


def recorded_facts(facts: RoundFacts) -> dict[str, Any]:
    """The facts as RoundRecord fields (the log's round record is built from them)."""
    values = {name: getattr(facts, name) for name in RECORDED_FACTS}
    values["tap_shape"] = list(facts.tap_shape)
    return values


def facts_from_record(record: Any, committed_before: int) -> RoundFacts:
    """The facts a logged round record states, for auditing the log without the models."""
    values = {name: getattr(record, name) for name in RECORDED_FACTS}
    values["tap_shape"] = tuple(record.tap_shape)
    return RoundFacts(committed_before=committed_before, **values)


class RoundAuditor:
    """Checks each round of one request against the invariants and against the round before.

    It counts committed tokens itself rather than trusting the record, so a round that
    claims the wrong history is caught too.
    """

    def __init__(self, prompt_len: int, n_taps: int, hidden_size: int) -> None:
        self.n_taps, self.hidden_size = n_taps, hidden_size
        self.committed = prompt_len + 1  # the prefill's first token
        self.previous: RoundFacts | None = None

    def check(self, facts: RoundFacts) -> None:
        """Raise the named error of the first invariant this round breaks, else record it."""
        self._check_history(facts)
        self._check_round(facts)
        self.committed += len(facts.committed)
        self.previous = facts

    def _check_history(self, facts: RoundFacts) -> None:
        if facts.committed_before != self.committed:
            raise LagViolation(f"round claims {facts.committed_before} committed tokens, {self.committed} were", facts)
        prev = self.previous
        if prev is not None and facts.drafter_ctx_before < prev.drafter_ctx_after:
            raise RollbackViolation(
                f"drafter context went back from {prev.drafter_ctx_after} to {facts.drafter_ctx_before} "
                "between rounds", facts)

    def _check_round(self, facts: RoundFacts) -> None:
        a = facts.accepted
        if facts.target_kv_before != self.committed - 1:
            raise LagViolation(
                f"target KV holds {facts.target_kv_before} positions at round start, expected one behind "
                f"the {self.committed} committed tokens", facts)
        if facts.anchor_pos != facts.target_kv_before:
            raise LagViolation(f"anchor at {facts.anchor_pos}, but the target KV ends at {facts.target_kv_before}", facts)
        if facts.tap_shape != (facts.block_size, self.n_taps * self.hidden_size):
            raise LayoutViolation(
                f"verify taps have shape {facts.tap_shape}, expected [token={facts.block_size}, "
                f"layer*dim={self.n_taps}*{self.hidden_size}]", facts)
        n = len(facts.drafts)
        if not 0 <= a <= n or facts.drafts[:a] != facts.target_tokens[:a]:
            raise AcceptanceViolation(f"accepted {a} drafts that are not the target's own tokens", facts)
        if facts.greedy and a < n and facts.drafts[a] == facts.target_tokens[a]:
            raise AcceptanceViolation(f"draft {a} equals the target's token but was rejected", facts)
        if facts.committed != facts.drafts[:a] + [facts.target_tokens[a]]:
            raise AcceptanceViolation("committed tokens are not the accepted drafts plus the target's bonus", facts)
        if facts.new_ctx_rows != a + 1:
            raise TrimViolation(f"{facts.new_ctx_rows} new context rows, expected exactly a+1 = {a + 1}", facts)
        if facts.target_kv_after != facts.target_kv_before + a + 1:
            raise TrimViolation(
                f"target KV ends at {facts.target_kv_after} after the round, expected "
                f"{facts.target_kv_before} + a+1 = {facts.target_kv_before + a + 1} (rejected drafts not dropped)", facts)
        if facts.drafter_ctx_after < facts.drafter_ctx_before:
            raise RollbackViolation(
                f"drafter context shrank from {facts.drafter_ctx_before} to {facts.drafter_ctx_after}", facts)
        if facts.drafter_ctx_after + facts.new_ctx_rows != facts.target_kv_after:
            raise TrimViolation(
                f"drafter context {facts.drafter_ctx_after} + pending {facts.new_ctx_rows} rows does not cover "
                f"exactly the {facts.target_kv_after} target-accepted positions", facts)
