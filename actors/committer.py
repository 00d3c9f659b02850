"""The committer: the only place the host reads a round's results.

It waits for round N's verdict (by then round N+1 is already queued in pipelined mode),
checks the lag, trim, no-rollback, layout and accepted-prefix invariants, streams the
committed tokens to the caller, writes the round's log record, and acknowledges the
round. It ends requests (EOS, stop string, max_tokens, cancellation, failure) and
discards the speculative rounds that were started after a request's last one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from protocol import (ActorMessage, Admit, Cancelled, Failed, FinishRecord, Prefilled, RoundAck, RoundRecord,
                      TokenEvent, Usage, Verified)
from runtime.invariants import InvariantError, RoundAuditor, RoundFacts, recorded_facts
from runtime.sampling import is_greedy
from runtime.stopping import Emission, TextStream, delivered_tokens
from runtime.tokenizer import Tokenizer

from .mailbox import Actor

MAX_YIELDS_FOR_NEXT_ROUND = 64  # a bound, so a stalled drafter cannot stall commits

if TYPE_CHECKING:
    from .drafter import Drafter
    from .verifier import Verifier


@dataclass
class CommitterRequest:
    stream: TextStream
    auditor: RoundAuditor
    events: ObjectSendStream[TokenEvent]
    prompt_len: int
    greedy: bool
    admitted_at: float
    first_token_at: float | None = None
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    delivered: list[int] = field(default_factory=list)  # per round, the tokens up to max_tokens (tau's)
    block_sizes: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # requests in each round's forwards
    idle_s: list[float] = field(default_factory=list)
    last_ready_at: float | None = None


class Committer(Actor):
    name = "committer"

    def __init__(self, tokenizer: Tokenizer, n_taps: int, hidden_size: int, inbox: ObjectReceiveStream[ActorMessage],
                 log: Callable[[object], None] | None = None) -> None:
        super().__init__(inbox)
        self.tokenizer, self.n_taps, self.hidden_size = tokenizer, n_taps, hidden_size
        self.requests: dict[str, CommitterRequest] = {}
        self.log = log  # None: no records are built at all
        self.acks: list[ObjectSendStream[ActorMessage]] = []  # drafter and verifier inboxes
        self.verifier: Verifier | None = None
        self.drafter: Drafter | None = None
        self.discarded_rounds = 0

    def register(self, request_id: str, admit: Admit, events: ObjectSendStream[TokenEvent]) -> None:
        params = admit.params
        self.requests[request_id] = CommitterRequest(
            TextStream(self.tokenizer, params.max_tokens, params.stop),
            RoundAuditor(len(admit.prompt_ids), self.n_taps, self.hidden_size),
            events, len(admit.prompt_ids), is_greedy(params), time.perf_counter(),
        )

    def forget(self, request_id: str, last: TokenEvent | None = None) -> None:
        """Drop the request; its caller gets ``last`` (if any), then the end of its stream."""
        request = self.requests.pop(request_id, None)
        if request is not None:
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
            await self._commit_round(message, request)
        elif isinstance(message, Failed):
            await self._finish(message.request_id, request, "error", error=message.error)

    def cancel(self, request_id: str) -> None:
        request = self.requests.get(request_id)
        if request is not None:
            self._log_finish(request_id, request, "cancelled", discarded=self._rounds_in_flight(request_id, request))
            self.forget(request_id)

    def _rounds_in_flight(self, request_id: str, request: CommitterRequest) -> int:
        """Rounds the drafter started past the last committed one: what finishing now discards.

        Taken before the finishing acks go out, since they make the drafter forget the request.
        """
        assert self.drafter is not None
        drafting = self.drafter.requests.get(request_id)
        return drafting.next_round - request.rounds if drafting is not None else 0

    async def _first_token(self, request_id: str, request: CommitterRequest) -> None:
        assert self.verifier is not None
        token = self.verifier.outputs(request_id, -1).host().bonus
        request.first_token_at = request.last_ready_at = time.perf_counter()
        await self._emit(request_id, request, request.stream.push([token]), -1, kv=request.prompt_len, ctx=0)

    def _facts(self, message: Verified, request: CommitterRequest) -> tuple[RoundFacts, float]:
        """Read round N's results from their owners: the only host sync of the round."""
        assert self.verifier is not None and self.drafter is not None
        out = self.verifier.outputs(message.request_id, message.round)
        drafted = self.drafter.outputs(message.request_id, message.round)
        verified, draft = out.host(), drafted.host()  # the first row read of a step waits for the step
        ready = time.perf_counter()
        a = verified.accepted
        facts = RoundFacts(
            round=message.round, anchor_pos=verified.kv_before, block_size=message.block_size, drafts=draft.drafts,
            target_tokens=verified.target_tokens, accepted=a,
            committed=draft.drafts[:a] + [verified.bonus], committed_before=request.auditor.committed,
            target_kv_before=verified.kv_before, target_kv_after=verified.kv_after,
            drafter_ctx_before=draft.ctx_before, drafter_ctx_after=draft.ctx_after,
            new_ctx_rows=verified.keep,  # the rows the drafter really keeps, not a+1 assumed
            tap_shape=tuple(out.taps.shape[1:]), greedy=request.greedy,
        )
        return facts, ready

    async def _next_round_queued(self, message: Verified) -> None:
        """Before blocking on round N, let the rounds drafted ahead of it reach the device queue.

        Reading round N blocks this thread until the device finishes it; if round N+1 (and
        N+2 with two rounds of lookahead) is not queued by then, the device idles while the
        host builds it.
        """
        assert self.verifier is not None and self.drafter is not None
        rid, last = message.request_id, message.round + self.drafter.lookahead
        # draft-ahead verifies round N+1 only after this commit: only its draft can be queued first
        queued = self.drafter.has_round if self.verifier.verify_after_commit else self.verifier.has_round
        for _ in range(MAX_YIELDS_FOR_NEXT_ROUND):
            if self.drafter.lookahead == 0 or queued(rid, last) or not self.drafter.will_draft(rid, last):
                return
            await anyio.sleep(0)

    async def _commit_round(self, message: Verified, request: CommitterRequest) -> None:
        await self._next_round_queued(message)
        if message.request_id not in self.requests:
            return  # cancelled while we yielded
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
        discarded = self._rounds_in_flight(request_id, request) if finished else 0
        for inbox in self.acks:
            await inbox.send(RoundAck(request_id=request_id, round=round, finished=finished, target_kv=kv,
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
            self.cancel(request_id)

    async def _finish(self, request_id: str, request: CommitterRequest, reason: str, error: str | None = None) -> None:
        discarded = self._rounds_in_flight(request_id, request)
        for inbox in self.acks:
            await inbox.send(Cancelled(request_id=request_id))
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
