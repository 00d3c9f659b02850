"""The committer: the only place the host reads a round's results.

It reads round N once the schedule lets it (``Schedule.may_commit``: in the pipelined
modes once round N+1, or N+2, is drafted and queued behind it), checks the lag, trim, no-rollback, layout and accepted-prefix invariants, streams the
committed tokens to the caller, writes the round's log record, and acknowledges the
round. It ends requests (EOS, stop string, max_tokens, cancellation, failure) and
discards the speculative rounds that were started after a request's last one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import anyio
from anyio.abc import ObjectSendStream

from protocol import (ActorMessage, Admit, Cancelled, Drafted, Failed, FinishRecord, Prefilled, RoundAck, RoundRecord,
                      TokenEvent, Usage, Verified)
from runtime.invariants import InvariantError, RoundAuditor, RoundFacts, recorded_facts
from runtime.sampling import is_greedy
from runtime.stopping import Emission, TextStream, delivered_tokens
from runtime.tokenizer import Tokenizer

from .mailbox import Actor, Inbox, Outbox, send_soon
from .rounds import DraftOutputs, RoundOutputs, RoundReader
from .schedule import NONE, PREFILL, Schedule


@dataclass
class CommitterRequest:
    stream: TextStream
    auditor: RoundAuditor
    events: ObjectSendStream[TokenEvent]
    prompt_len: int
    max_tokens: int
    greedy: bool
    admitted_at: float
    drafted: int = NONE  # latest round known drafted (its Drafted has come)
    unread: dict[int, Verified] = field(default_factory=dict)  # rounds verified, not yet read and committed
    first_token_at: float | None = None
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)  # per round, the tokens up to max_tokens (tau's)
    block_sizes: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # requests in each round's forwards
    idle_s: list[float] = field(default_factory=list)
    last_ready_at: float | None = None


class Committer(Actor):
    """Reads Prefilled, Drafted, Verified and Failed; sends RoundAck or Cancelled to the drafter and the verifier.

    ``verified`` and ``drafts``: the verifier's and the drafter's round results, by handle
    (read to the host here, and only here). The engine ``register``s each request first,
    with the stream its caller reads token events from.
    """

    name = "committer"

    def __init__(self, tokenizer: Tokenizer, n_taps: int, hidden_size: int, schedule: Schedule, inbox: Inbox, *,
                 verified: RoundReader[RoundOutputs], drafts: RoundReader[DraftOutputs], acks: Sequence[Outbox],
                 log: Callable[[object], None] | None = None) -> None:
        super().__init__(inbox)
        self.tokenizer, self.n_taps, self.hidden_size, self.schedule = tokenizer, n_taps, hidden_size, schedule
        self.verified, self.drafts = verified, drafts
        self.requests: dict[str, CommitterRequest] = {}
        self.log = log  # None: no records are built at all
        self.acks = list(acks)  # drafter and verifier inboxes
        self.discarded_rounds = 0

    def register(self, request_id: str, admit: Admit, events: ObjectSendStream[TokenEvent]) -> None:
        params = admit.params
        self.requests[request_id] = CommitterRequest(
            TextStream(self.tokenizer, params.max_tokens, params.stop),
            RoundAuditor(len(admit.prompt_ids), self.n_taps, self.hidden_size),
            events, len(admit.prompt_ids), params.max_tokens, is_greedy(params), time.perf_counter(),
        )

    def forget(self, request_id: str, last: TokenEvent | None = None) -> None:
        """Drop the request; its caller gets ``last`` (if any), then the end of its stream."""
        request = self.requests.pop(request_id, None)
        if request is not None:
            self.discarded_rounds += len(request.unread)  # verified behind the last one, never read
            if last is not None:
                self._deliver(request, last)
            request.events.close()

    @staticmethod
    def _deliver(request: CommitterRequest, event: TokenEvent) -> bool:
        """Hand an event to the caller; False if the caller is gone (it cancelled)."""
        try:
            request.events.send_nowait(event)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    async def report_failure(self, request_id: str, exc: Exception) -> None:
        """A failure while committing ends that request with an error event, nothing else."""
        request = self.requests.get(request_id)
        if request is not None:
            await self._finish(request_id, request, "error", error=f"committer: {type(exc).__name__}: {exc}")

    async def handle(self, message: ActorMessage) -> None:
        request = self.requests.get(message.request_id)
        if request is None:
            if isinstance(message, Verified):
                self.discarded_rounds += 1  # speculative round after the request ended
            return
        if isinstance(message, Prefilled):
            await self._first_token(message.request_id, request)
        elif isinstance(message, Verified):
            request.unread[message.round] = message
            request.drafted = max(request.drafted, message.round)
            await self._commit_ready(message.request_id, request)
        elif isinstance(message, Drafted):
            request.drafted = max(request.drafted, message.round)
            await self._commit_ready(message.request_id, request)
        elif isinstance(message, Failed):
            await self._finish(message.request_id, request, "error", error=message.error)

    def drop(self, request_id: str, rounds_started: int | None = None) -> None:
        """The caller left; ``rounds_started``: what the drafter has drafted for it (else as known here)."""
        request = self.requests.get(request_id)
        if request is not None:
            discarded = self._rounds_in_flight(request) if rounds_started is None else rounds_started - request.rounds
            self._log_finish(request_id, request, "cancelled", discarded=max(0, discarded))
            self.forget(request_id)

    @staticmethod
    def _rounds_in_flight(request: CommitterRequest) -> int:
        """Rounds drafted past the last committed one: what finishing now discards."""
        return max(0, request.drafted + 1 - request.rounds)

    async def _commit_ready(self, request_id: str, request: CommitterRequest) -> None:
        """Commit, in order, the verified rounds that the schedule lets the host read now."""
        while (request.rounds in request.unread and self.requests.get(request_id) is request
               and self.schedule.may_commit(request.rounds, request.drafted, len(request.stream.token_ids),
                                            request.max_tokens)):
            await self._commit_round(request.unread.pop(request.rounds), request)

    async def _first_token(self, request_id: str, request: CommitterRequest) -> None:
        token = self.verified.get(request_id, PREFILL).host().bonus
        request.first_token_at = request.last_ready_at = time.perf_counter()
        await self._emit(request_id, request, request.stream.push([token]), PREFILL, kv=request.prompt_len, ctx=0)

    def _facts(self, message: Verified, request: CommitterRequest) -> tuple[RoundFacts, float]:
        """Read round N's results from their owners: the only host sync of the round."""
        out = self.verified.get(message.request_id, message.round)
        drafted = self.drafts.get(message.request_id, message.round)
        verified, draft = out.host(), drafted.host()  # the first row read of a step waits for the step
        ready = time.perf_counter()
        a, drafts = verified.accepted, draft.blocks[verified.branch]
        facts = RoundFacts(
            round=message.round, anchor_pos=verified.kv_before, block_size=message.block_size, drafts=drafts,
            target_tokens=verified.target_tokens, accepted=a,
            committed=drafts[:a] + [verified.bonus], committed_before=request.auditor.committed,
            target_kv_before=verified.kv_before, target_kv_after=verified.kv_after,
            drafter_ctx_before=draft.ctx_before, drafter_ctx_after=draft.ctx_after,
            new_ctx_rows=verified.keep,  # the rows the drafter really keeps, not a+1 assumed
            tap_shape=out.tap_shape, greedy=request.greedy, branch=verified.branch,
        )
        return facts, ready

    async def _commit_round(self, message: Verified, request: CommitterRequest) -> None:
        facts, ready = self._facts(message, request)
        try:
            request.auditor.check(facts)
        except InvariantError as exc:
            await self._finish(message.request_id, request, "error", error=str(exc))
            return
        if request.last_ready_at is not None:  # GPU idle: nothing queued between two rounds
            request.idle_s.append(max(0.0, message.draft_queued_at - request.last_ready_at))
        request.last_ready_at = ready
        request.rounds += 1
        request.accepted.append(facts.accepted)
        request.delivered.append(delivered_tokens(len(facts.committed), request.stream.remaining))
        request.block_sizes.append(facts.block_size)
        request.batch_sizes.append(message.batch_size)
        emission = request.stream.push(facts.committed)
        if self.log is not None:
            self.log(RoundRecord(
                request_id=message.request_id, time=time.time(), **recorded_facts(facts), speculative=message.speculative,
                draft_queued=message.draft_queued_at, draft_ready=None, verify_queued=message.verify_queued_at,
                verify_ready=ready, commit=time.perf_counter(), batch_size=message.batch_size,
            ))
        await self._emit(message.request_id, request, emission, facts.round, kv=facts.target_kv_after, ctx=facts.drafter_ctx_after)

    async def _emit(self, request_id: str, request: CommitterRequest, emission: Emission, round: int, kv: int, ctx: int) -> None:
        finished = emission.finish_reason is not None
        discarded = self._rounds_in_flight(request) if finished else 0
        for inbox in self.acks:
            await send_soon(inbox, RoundAck(request_id=request_id, round=round, finished=finished, target_kv=kv,
                                      drafter_ctx=ctx, generated=len(request.stream.token_ids)))
        event = TokenEvent(request_id=request_id, token_ids=emission.token_ids, text=emission.text,
                           finish_reason=emission.finish_reason,
                           usage=self._usage(request) if finished else None,
                           timings=self._timings(request) if finished else {},
                           stats=self._stats(request) if finished else {})
        if finished:
            self._log_finish(request_id, request, emission.finish_reason or "stop", discarded=discarded)
            self.forget(request_id, last=event)
        elif not self._deliver(request, event):
            self.drop(request_id)

    async def _finish(self, request_id: str, request: CommitterRequest, reason: str, error: str | None = None) -> None:
        discarded = self._rounds_in_flight(request)
        for inbox in self.acks:
            await send_soon(inbox, Cancelled(request_id=request_id))
        self._log_finish(request_id, request, reason, error, discarded)
        last = TokenEvent(request_id=request_id, token_ids=[], text="", finish_reason=reason,
                          usage=self._usage(request), error=error)
        self.forget(request_id, last=last)

    def _log_finish(self, request_id: str, request: CommitterRequest, reason: str, error: str | None = None,
                    discarded: int = 0) -> None:
        if self.log is not None:
            self.log(FinishRecord(request_id=request_id, time=time.time(), finish_reason=reason,
                                  token_ids=list(request.stream.token_ids), text=request.stream.text,
                                  rounds=request.rounds, error=error, discarded_rounds=discarded))

    @staticmethod
    def _usage(request: CommitterRequest) -> Usage:
        n = len(request.stream.token_ids)
        return Usage(prompt_tokens=request.prompt_len, completion_tokens=n, total_tokens=request.prompt_len + n)

    @staticmethod
    def _timings(request: CommitterRequest) -> dict[str, float]:
        now = time.perf_counter()
        first = request.first_token_at or now
        decode = now - first
        n = len(request.stream.token_ids) - 1
        return {"ttft_s": first - request.admitted_at, "decode_s": decode,
                "tokens_per_s": n / decode if n > 0 and decode > 0 else 0.0,
                "gpu_idle_s": sum(request.idle_s)}

    @staticmethod
    def _stats(request: CommitterRequest) -> dict[str, float | int | list[float]]:
        n = request.rounds
        block = max(request.block_sizes, default=1)
        return {"rounds": n, "tau": sum(request.delivered) / n if n else 0.0,
                "mean_batch_size": sum(request.batch_sizes) / n if n else 0.0,
                "acceptance_per_position": [sum(a >= k for a in request.accepted) / n if n else 0.0 for k in range(1, block)]}
