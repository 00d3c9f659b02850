"""Rebuilding each request's output from its rounds, and auditing every round.

The invariant checks are the committer's own (``runtime.invariants.RoundAuditor``), fed
with facts rebuilt from the round records. Output rule: the prefill's token is not in a
round record, it is the first streamed token (``FinishRecord.token_ids[0]``), so

    output = [token_ids[0]] + every round's committed tokens, cut to len(token_ids)

and the cut must be one the stream makes: EOS (the cut token itself is dropped), a stop
string, or max_tokens, inside the last round; cancelled and failed requests keep all.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol import FinishRecord, GenerationParams
from runtime.invariants import InvariantError, RoundAuditor, facts_from_record

from .reading import RequestLog

@dataclass
class Finding:
    """Something in the log that is not what a correct run writes."""

    request: str
    round: int | None  # None: the request as a whole
    check: str  # an invariant's name (lag, trim, no-rollback, layout, accepted-prefix) or output/rounds/finish/request
    message: str


def audit_request(log: RequestLog) -> list[Finding]:
    if log.request is None:
        return [Finding(log.key, None, "request", "no request record (its line is lost): prompt length and tap "
                                                  "layout unknown, so its rounds are not audited")]
    return [*_round_numbers(log), *_invariants(log), *_output(log)]


def _round_numbers(log: RequestLog) -> list[Finding]:
    numbers = [r.round for r in log.rounds]
    if numbers == list(range(len(numbers))):
        return []
    gap = next(i for i, n in enumerate(numbers) if n != i)
    return [Finding(log.key, gap, "rounds", f"round records are numbered {numbers[max(0, gap - 1):gap + 2]}... "
                                            f"at position {gap}: a round is missing or out of order")]


def _invariants(log: RequestLog) -> list[Finding]:
    """The committer's checks, round by round; only the first violation counts.

    The committer ends a request at its first violation, and the auditor's running count
    is not advanced past it, so later rounds could only repeat it.
    """
    assert log.request is not None
    request = log.request
    auditor = RoundAuditor(len(request.prompt_ids), request.n_taps, request.hidden_size)
    for i, record in enumerate(log.rounds):
        try:
            auditor.check(facts_from_record(record, auditor.committed))
        except InvariantError as exc:
            later = len(log.rounds) - 1 - i
            suffix = f" ({later} later round(s) not audited)" if later else ""
            return [Finding(log.key, record.round, exc.invariant, exc.detail + suffix)]
    return []


def rebuilt_output(log: RequestLog) -> list[int]:
    """Every token the request produced (the module's rule), before the stream's cut."""
    streamed = log.finish.token_ids if log.finish is not None else []
    return streamed[:1] + [t for r in log.rounds for t in r.committed]


def _round_of(log: RequestLog, index: int) -> int:
    """The round whose commit produced output token ``index`` (-1: the prefill's token)."""
    if index == 0:
        return -1
    end = 1
    for record in log.rounds:
        end += len(record.committed)
        if index < end:
            return record.round
    return log.rounds[-1].round if log.rounds else -1  # past every round: the stream holds more


def _output(log: RequestLog) -> list[Finding]:
    assert log.request is not None
    finish = log.finish
    if finish is None:
        return [Finding(log.key, None, "finish", "no finish record: the log ends before the request did")]
    findings = []
    if finish.rounds != len(log.rounds):
        findings.append(Finding(log.key, None, "finish",
                                f"the finish record counts {finish.rounds} rounds, the log holds {len(log.rounds)}"))
    streamed = finish.token_ids
    if not streamed:
        if log.rounds:
            findings.append(Finding(log.key, log.rounds[0].round, "output", "rounds committed tokens, none was streamed"))
        return findings
    full = rebuilt_output(log)
    n = len(streamed)
    diff = next((i for i, (a, b) in enumerate(zip(full, streamed)) if a != b), None)
    if diff is None and n > len(full):
        diff = len(full)
    if diff is not None:
        rebuilt = full[diff] if diff < len(full) else "nothing"
        findings.append(Finding(log.key, _round_of(log, diff), "output",
                                f"output token {diff}: rebuilt {rebuilt}, streamed {streamed[diff]}"))
        return findings
    last_group = len(log.rounds[-1].committed) if log.rounds else 1
    problem = _cut_problem(finish, log.request.params, full, n, last_group)
    if problem:
        findings.append(Finding(log.key, log.rounds[-1].round if log.rounds else -1, "output", problem))
    return findings


def _cut_problem(finish: FinishRecord, params: GenerationParams, full: list[int], n: int, last_group: int) -> str | None:
    """Why streaming ``n`` of the ``full`` tokens is not the cut ``finish_reason`` makes, if it is not."""
    reason = finish.finish_reason
    if reason in ("cancelled", "error"):  # ended from outside: everything committed was streamed
        return None if n == len(full) else f"{reason} after streaming {n} of {len(full)} committed tokens"
    if reason not in ("stop", "length"):
        return f"unknown finish reason {reason!r}"
    if not len(full) - last_group <= n <= len(full):
        return f"the stream ended ({reason}) at token {n}, outside the last round's tokens"
    if reason == "length":
        return None if n == params.max_tokens else f"finished for length with {n} tokens, max_tokens is {params.max_tokens}"
    if params.stop:
        return None  # a stop string may end at any token of the last round, and that token is streamed
    # no stop strings: an EOS ended the stream, and the EOS itself is not streamed
    if n == len(full):
        return "finished at EOS, but no committed token follows the streamed ones"
    if full[n] in full[:n]:
        return f"finished at EOS token {full[n]}, which was streamed earlier: the stream stops at the first EOS"
    return None
