"""The drafter: owns the DFlash drafter and every request's drafter cache.

Round N+1 is drafted as soon as round N's verdict is queued (pipelined) or once the
committer has acknowledged round N (sequential). Its anchor is round N's bonus token and
its new context the verify taps, of which the device-side ``a+1`` rows are kept: the
host never has to wait for round N to start N+1.

Requests advance in lockstep: a flush drafts the next round of every request that is
ready, in one forward over their stacked caches (kept from step to step while the same
requests draft together: runtime.cache.KeptStack), but not while some request that has
drafted before is still waiting for its verdict or acknowledgement: it will be ready
within the step, and drafting without it would split the batch for good. Newcomers join
at the next step; their prompt context is written alone first, since its length is theirs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Sequence

import mlx.core as mx
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from protocol import ActorMessage, Admit, Cancelled, Drafted, RoundAck, VerdictQueued
from runtime.batching import HostReadout, default_pad_batches, pad_rows, padded_batch
from runtime.cache import DeviceKVCache, KeptStack, restored_on_failure
from runtime.models.dflash import DFlashDrafter, Proposal
from runtime.sampling import Sampler
from runtime.speculative import block_size_for, draft_sampler, propose_drafts

from .mailbox import DeviceStateOwner, send_burst

if TYPE_CHECKING:
    from .verifier import RoundOutputs, Verifier


class DraftedRow(NamedTuple):
    drafts: list[int]
    ctx_before: int
    ctx_after: int


@dataclass
class DraftOutputs:
    drafts: mx.array  # [width-1]: the request's full block width; the first block-1 are real
    block_size: int
    readout: HostReadout  # the step's drafts, context lengths before and after
    row: int
    probs: mx.array | None = None  # [width-1, V]: the q the drafts were drawn from (DFlash 2 sampling), else None

    def host(self) -> DraftedRow:
        values = self.readout.row(self.row).tolist()
        return DraftedRow(values[: self.block_size - 1], values[-2], values[-1])


@dataclass
class DrafterRequest:
    cache: list[DeviceKVCache]
    block_size: int
    max_tokens: int
    next_round: int = 0
    verdict_queued: int = -2  # latest round whose verdict is on the device queue
    acked: int = -2  # latest round the committer acknowledged
    generated: int = 0  # tokens committed as of the latest ack
    outputs: dict[int, DraftOutputs] = field(default_factory=dict)
    sampler: Sampler | None = None  # the drafter's own draws (runtime.speculative.draft_sampler)


class Drafter(DeviceStateOwner[DrafterRequest]):
    name = "drafter"

    def __init__(self, drafter: DFlashDrafter, inbox: ObjectReceiveStream[ActorMessage], lookahead: int,
                 pad_batches: bool | None = None) -> None:
        super().__init__(inbox)
        self.drafter = drafter
        self.pad_batches = default_pad_batches() if pad_batches is None else pad_batches
        self.lookahead = lookahead  # rounds drafted beyond the last acknowledged one: 0, 1 or 2
        self.verifier_inbox: ObjectSendStream[ActorMessage] | None = None
        self.verifier: Verifier | None = None
        self._stack = KeptStack()  # the last batched step's stacked caches, while its requests stay together

    def outputs(self, request_id: str, round: int) -> DraftOutputs:
        return super().outputs(request_id, round)

    def forget(self, request_id: str) -> None:
        if self._stack.holds(request_id):
            self._stack.break_up()
        super().forget(request_id)

    @property
    def cache_bytes(self) -> int:
        return super().cache_bytes + self._stack.nbytes

    def has_round(self, request_id: str, round: int) -> bool:
        """Whether ``round``'s drafts are queued (and not yet acknowledged)."""
        request = self.requests.get(request_id)
        return request is not None and round in request.outputs

    def will_draft(self, request_id: str, round: int) -> bool:
        """Whether ``round`` will still be drafted for the request (it is not past max_tokens)."""
        request = self.requests.get(request_id)
        return request is not None and request.next_round <= round and self._needed(request, round)

    async def handle(self, message: ActorMessage) -> None:
        if isinstance(message, Admit):
            self.requests[message.request_id] = DrafterRequest(
                self.drafter.make_device_cache(), block_size_for(self.drafter, message.params), message.params.max_tokens,
                sampler=draft_sampler(self.drafter, message.params))
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
        if ack.round >= 0:
            for layer in request.cache:
                layer.settle(ack.drafter_ctx)
            request.outputs.pop(ack.round, None)

    @staticmethod
    def _needed(request: DrafterRequest, round: int) -> bool:
        """Whether ``round`` can still commit a token: each unacknowledged round before it commits one.

        A needed round drafts its whole block even near max_tokens (the committer trims what
        lies past it): a block shrunk to what remains would draft differently in each mode,
        since only the sequential one knows how many the rounds in flight commit.
        """
        in_flight = round - 1 - request.acked
        return request.max_tokens - request.generated - in_flight >= 1

    def _ready(self, request: DrafterRequest) -> bool:
        return (request.next_round == request.verdict_queued + 1
                and request.acked >= request.next_round - 1 - self.lookahead)

    async def flush(self) -> None:
        ready, waiting = [], False
        for request_id, request in self.requests.items():
            if not self._needed(request, request.next_round):
                continue  # the rounds in flight already reach max_tokens
            if self._ready(request):
                ready.append(request_id)
            elif request.next_round > 0:
                waiting = True
        if ready and not waiting:
            await self.run_batch(ready, self._draft)

    async def _draft(self, request_ids: Sequence[str]) -> None:
        """Draft the next round of each request, in one forward."""
        assert self.verifier is not None and self.verifier_inbox is not None
        requests = [self.requests[rid] for rid in request_ids]
        rounds = [r.next_round for r in requests]
        blocks = [r.block_size for r in requests]
        previous = [self.verifier.outputs(rid, n - 1) for rid, n in zip(request_ids, rounds)]
        # newcomers' context is written before the step, outside any stack (they never are in one)
        with restored_on_failure([r.cache for r, p in zip(requests, previous) if p.block_size == 0]):
            (drafts, probs), ctx_before, ctx_after = self._forward(list(request_ids), requests, previous)
        readout = HostReadout([drafts, ctx_before, ctx_after])
        for row, (request, round, block) in enumerate(zip(requests, rounds, blocks)):
            q = probs[row] if probs is not None and request.sampler is not None else None
            request.outputs[round] = DraftOutputs(drafts[row], block, readout, row, q)
            request.next_round += 1
        mx.async_eval(readout.packed)
        now = time.perf_counter()
        await send_burst(self.verifier_inbox, [Drafted(
            request_id=rid, round=round, block_size=block, speculative=r.acked < round - 1, draft_queued_at=now,
            batch_size=len(requests)) for rid, r, round, block in zip(request_ids, requests, rounds, blocks)])

    def _forward(self, ids: list[str], requests: Sequence[DrafterRequest],
                 previous: Sequence[RoundOutputs]) -> tuple[Proposal, mx.array, mx.array]:
        """Drafts ``[R, L-1]`` (with their q where sampled) and the context lengths before and after, for stacked requests.

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
        anchors = mx.stack([p.bonus for p in previous] + [zero] * (rows - n))
        mask = mx.full((rows, width - 1), self.drafter.args.mask_token_id, dtype=mx.int32)
        tokens = mx.concatenate([anchors[:, None], mask], axis=1)
        lens = [r.block_size for r in requests] + [1] * (rows - n)
        block_lens = mx.array(lens) if min(lens) < width else None
        ctx_rows = width if not all(fresh) else 0
        ctx, keep = previous[0].taps, previous[0].keep
        if rows > 1:
            ctx = keep = None
            if ctx_rows:  # newcomers and blank rows take part with zero rows, none kept
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
                                    [r.block_size for r in requests])
        else:
            drafts = Proposal(mx.zeros((n, 0), dtype=mx.int32), None)
        return drafts, ctx_before, ctx_after
