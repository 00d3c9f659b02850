"""The drafter: owns the DFlash drafter and every request's drafter cache.

Round N+1 is drafted from round N's verdict once it is queued, as far ahead of the
committer as the mode's schedule allows (actors/schedule.py). Its anchor is round N's
bonus token and its new context the verify taps, of which the device-side ``a+1`` rows are
kept: the host never has to wait for round N to start N+1.

Requests advance in lockstep (``Schedule.draft_step``): a flush drafts the next round of
every request that is ready, in one forward over their stacked caches (kept from step to
step, re-formed as requests join and leave: runtime.cache.KeptStack). Newcomers join at
the next step; their prompt context is written alone first, since its length is theirs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from protocol import ActorMessage, Admit, Cancelled, Drafted, RoundAck, VerdictQueued
from runtime.batching import HostReadout, default_pad_batches, pad_rows, padded_batch
from runtime.cache import DeviceKVCache, KeptStack, restored_on_failure
from runtime.lookup import TokenHistory, histories_drafts
from runtime.models.dflash import DFlashDrafter, Proposal
from runtime.sampling import Sampler
from runtime.speculative import block_size_for, draft_sampler, propose_drafts

from .mailbox import DeviceStateOwner, Inbox, Outbox, send_burst
from .rounds import DraftOutputs, DraftStep, RoundOutputs, RoundReader, RoundResults, stacked_rows
from .schedule import NONE, PREFILL, Schedule


@dataclass
class DrafterRequest:
    cache: list[DeviceKVCache]
    block_size: int
    max_tokens: int
    next_round: int = 0
    verdict_queued: int = NONE  # latest round whose verdict is on the device queue
    acked: int = NONE  # latest round the committer acknowledged
    generated: int = 0  # tokens committed as of the latest ack
    sampler: Sampler | None = None  # the drafter's own draws (runtime.speculative.draft_sampler)
    history: TokenHistory | None = None  # its tokens, where rounds verify several blocks (runtime/lookup.py)


class Drafter(DeviceStateOwner[DrafterRequest, DraftOutputs]):
    """Reads Admit, VerdictQueued, RoundAck and Cancelled; sends Drafted to the verifier and the committer.

    ``verified``: the verifier's round results, by handle (the anchors and taps drafted from).
    """

    name = "drafter"

    def __init__(self, drafter: DFlashDrafter, schedule: Schedule, inbox: Inbox, *, verified: RoundReader[RoundOutputs],
                 verifier: Outbox, committer: Outbox, results: RoundResults[DraftOutputs] | None = None, pad_batches: bool | None = None,
                 branches: int = 1) -> None:
        """``branches``: blocks a round drafts for the verifier to choose from (runtime/branches.py)."""
        super().__init__(inbox, failures=committer, results=results)
        self.drafter, self.schedule, self.branches = drafter, schedule, branches
        self.pad_batches = default_pad_batches() if pad_batches is None else pad_batches
        self.verified = verified
        self.verifier, self.committer = verifier, committer
        self._stack = KeptStack()  # the last batched step's stacked caches, while its requests stay together

    def forget(self, request_id: str) -> None:
        self._stack.drop(request_id)
        super().forget(request_id)

    @property
    def cache_bytes(self) -> int:
        return super().cache_bytes + self._stack.nbytes

    def rounds_started(self, request_id: str) -> int:
        """Rounds drafted so far for the request (0 if it is unknown here)."""
        request = self.requests.get(request_id)
        return request.next_round if request is not None else 0

    async def handle(self, message: ActorMessage) -> None:
        if isinstance(message, Admit):
            block = block_size_for(self.drafter, message.params)
            history = TokenHistory.for_request(message.prompt_ids, message.params.max_tokens, block) \
                if self.drafter.copies_blocks else None
            self.requests[message.request_id] = DrafterRequest(
                self.drafter.make_device_cache(), block, message.params.max_tokens,
                sampler=draft_sampler(self.drafter, message.params), history=history)
            return
        request = self.requests.get(message.request_id)
        if request is None:
            return  # finished or cancelled: late messages about it are moot
        if isinstance(message, Cancelled):
            self.forget(message.request_id)
        elif isinstance(message, VerdictQueued):
            request.verdict_queued = message.round
        elif isinstance(message, RoundAck):
            if message.finished:
                self.forget(message.request_id)
                return
            self._acknowledged(request, message)

    def _acknowledged(self, request: DrafterRequest, ack: RoundAck) -> None:
        request.acked, request.generated = ack.round, ack.generated
        if ack.round > PREFILL:
            for layer in request.cache:
                layer.settle(ack.drafter_ctx)
            self.results.pop(ack.request_id, ack.round)

    async def flush(self) -> None:
        ready = self.schedule.draft_step(self.requests)
        if ready:
            await self.run_batch(ready, self._draft)

    async def _draft(self, request_ids: Sequence[str]) -> None:
        """Draft the next round of each request, in one forward."""
        requests = [self.requests[rid] for rid in request_ids]
        rounds = [r.next_round for r in requests]
        blocks = [r.block_size for r in requests]
        previous = [self.verified.get(rid, n - 1) for rid, n in zip(request_ids, rounds)]
        # newcomers' context is written before the step, outside any stack (they never are in one)
        with restored_on_failure([r.cache for r, p in zip(requests, previous) if p.block_size == 0]):
            (drafts, probs), ctx_before, ctx_after = self._forward(list(request_ids), requests, previous)
        step = DraftStep(drafts, probs, HostReadout([drafts, ctx_before, ctx_after]))
        for row, (request_id, request, round, block) in enumerate(zip(request_ids, requests, rounds, blocks)):
            self.results.put(request_id, round, DraftOutputs(step, row, block, request.sampler is not None))
            request.next_round += 1
        mx.async_eval(step.readout.packed)
        now = time.perf_counter()
        drafted = [Drafted(request_id=rid, round=round, block_size=block, speculative=r.acked < round - 1,
                           draft_queued_at=now, batch_size=len(requests))
                   for rid, r, round, block in zip(request_ids, requests, rounds, blocks)]
        # the committer first: it reads the round before, which now has this one queued behind it
        await send_burst(self.committer, drafted)
        await send_burst(self.verifier, drafted)

    def _forward(self, ids: list[str], requests: Sequence[DrafterRequest],
                 previous: Sequence[RoundOutputs]) -> tuple[Proposal, mx.array, mx.array]:
        """Drafts ``[R, K, L-1]`` (with their q where sampled) and the context lengths before and after, for stacked requests.

        Every row drafts at the widest block of the batch (a request's smaller block is
        masked, not cut, so it drafts as alone); blank rows pad the batch when asked.
        """
        n = len(requests)
        rows = padded_batch(n) if self.pad_batches else n
        width = max(r.block_size for r in requests)
        fresh = [p.block_size == 0 for p in previous]  # after the prefill: the whole prompt is new context
        # newcomers' context length before it is written (their lengths in a stack are after it)
        before = {row: r.cache[0].length for row, (r, new) in enumerate(zip(requests, fresh)) if new}
        for request, prev, new in zip(requests, previous, fresh):
            if new and rows > 1:
                self.drafter.write_context(prev.taps, request.cache, prev.keep)
        zero = mx.array(0, dtype=mx.int32)
        anchors = stacked_rows([(p.step.bonus, p.row) for p in previous], rows)
        mask = mx.full((rows, width - 1), self.drafter.args.mask_token_id, dtype=mx.int32)
        tokens = mx.concatenate([anchors[:, None], mask], axis=1)
        lens = [r.block_size for r in requests] + [1] * (rows - n)
        block_lens = mx.array(lens) if min(lens) < width else None
        ctx_rows = width if not all(fresh) else 0
        ctx, keep = previous[0].taps, previous[0].keep
        if rows > 1:
            ctx = keep = None
            if ctx_rows and not any(fresh) and all(p.step.taps.shape[1] == ctx_rows for p in previous):
                # the verify steps' rows whole: rows past a request's keep are never attended
                ctx = stacked_rows([(p.step.taps, p.row) for p in previous], rows)
                keep = stacked_rows([(p.step.keep, p.row) for p in previous], rows)
            elif ctx_rows:  # newcomers and blank rows take part with zero rows, none kept
                none = previous[0].taps[0, :0]
                ctx = pad_rows([p.taps[0] if not new else none for p, new in zip(previous, fresh)]
                               + [none] * (rows - n), ctx_rows)
                keep = mx.stack([p.keep if not new else zero for p, new in zip(previous, fresh)] + [zero] * (rows - n))
        written = [0 if new else ctx_rows for new in fresh]
        with self._stack.stacked(ids, [r.cache for r in requests], ctx_rows, rows, written) as caches:
            lengths = caches[0].length.reshape(-1)
            ctx_before = mx.stack([before[row] if row in before else lengths[row] for row in range(n)]) \
                if before and rows > 1 else lengths[:n]
            hidden = self.drafter.hidden(tokens, ctx, caches, keep=keep, block_lens=block_lens)
            ctx_after = caches[0].length.reshape(-1)[:n]
        if width > 1:
            drafts = propose_drafts(self.drafter, hidden[:n, 1:], anchors[:n], [r.sampler for r in requests],
                                    [r.block_size for r in requests], self.branches, self._copied(requests, previous, width))
        else:
            drafts = Proposal(mx.zeros((n, self.branches, 0), dtype=mx.int32), None)
        return drafts, ctx_before, ctx_after

    @staticmethod
    def _copied(requests: Sequence[DrafterRequest], previous: Sequence[RoundOutputs],
                width: int) -> tuple[mx.array, mx.array] | None:
        """Each request's block copied from its own text, the previous round's tokens appended to it first."""
        histories = [r.history for r in requests if r.history is not None]
        if len(histories) < len(requests):
            return None
        if len({p.step.tokens.shape[1] for p in previous}) == 1:
            tokens = stacked_rows([(p.step.tokens, p.row) for p in previous])
        else:  # newcomers' first token beside others' rounds
            tokens = pad_rows([p.step.tokens[p.row] for p in previous], width)
        if all(p.block_size for p in previous):  # rounds' keeps: their steps' rows, no op a row
            counts = stacked_rows([(p.step.keep, p.row) for p in previous])
        else:  # a prefill keeps its prompt's taps, but adds one token to the text
            counts = mx.stack([p.keep if p.block_size else mx.array(1, dtype=mx.int32) for p in previous])
        return histories_drafts(histories, tokens, counts, width - 1)
