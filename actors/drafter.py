"""The drafter: owns the DFlash drafter and every request's drafter cache.

Round N+1 is drafted as soon as round N's verdict is queued (pipelined) or once the
committer has acknowledged round N (sequential). Its anchor is round N's bonus token and
its new context the verify taps, of which the device-side ``a+1`` rows are kept: the
host never has to wait for round N to start N+1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from protocol import ActorMessage, Admit, Drafted, RoundAck, VerdictQueued
from runtime.cache import DeviceKVCache
from runtime.models.dflash import DFlashDrafter
from runtime.speculative import block_size_for

from .mailbox import DeviceStateOwner

if TYPE_CHECKING:
    from .verifier import Verifier


@dataclass
class DraftOutputs:
    drafts: mx.array  # [block-1]
    block_size: int
    ctx_before: mx.array
    ctx_after: mx.array


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


class Drafter(DeviceStateOwner[DrafterRequest]):
    name = "drafter"

    def __init__(self, drafter: DFlashDrafter, inbox: ObjectReceiveStream[ActorMessage], lookahead: int) -> None:
        super().__init__(inbox)
        self.drafter = drafter
        self.lookahead = lookahead  # rounds drafted beyond the last acknowledged one: 0 or 1
        self.verifier_inbox: ObjectSendStream[ActorMessage] | None = None
        self.verifier: Verifier | None = None

    def outputs(self, request_id: str, round: int) -> DraftOutputs:
        return super().outputs(request_id, round)

    def will_draft(self, request_id: str, round: int) -> bool:
        """Whether ``round`` will still be drafted for the request (it is not past max_tokens)."""
        request = self.requests.get(request_id)
        return request is not None and request.next_round <= round and self._block_for(request, round) >= 1

    async def handle(self, message: ActorMessage) -> None:
        if isinstance(message, Admit):
            self.requests[message.request_id] = DrafterRequest(
                self.drafter.make_device_cache(), block_size_for(self.drafter, message.params), message.params.max_tokens)
            return
        request = self.requests.get(message.request_id)
        if request is None:
            return  # finished or cancelled: late messages about it are moot
        if isinstance(message, VerdictQueued):
            request.verdict_queued = message.round
        elif isinstance(message, RoundAck):
            if message.finished:
                self.forget(message.request_id)
                return
            self._acknowledged(request, message)
        await self._draft_ready_rounds(message.request_id, request)

    def _acknowledged(self, request: DrafterRequest, ack: RoundAck) -> None:
        request.acked, request.generated = ack.round, ack.generated
        if ack.round >= 0:
            for layer in request.cache:
                layer.settle(ack.drafter_ctx)
            request.outputs.pop(ack.round, None)

    def _block_for(self, request: DrafterRequest, round: int) -> int:
        """Shrink the block near max_tokens: each unacknowledged round commits at least one."""
        in_flight = round - 1 - request.acked
        remaining = request.max_tokens - request.generated - in_flight
        return min(request.block_size, remaining)

    async def _draft_ready_rounds(self, request_id: str, request: DrafterRequest) -> None:
        while (request.next_round == request.verdict_queued + 1
               and request.acked >= request.next_round - 1 - self.lookahead):
            block = self._block_for(request, request.next_round)
            if block < 1:
                return  # the rounds in flight already reach max_tokens
            await self._draft(request_id, request, block)

    async def _draft(self, request_id: str, request: DrafterRequest, block: int) -> None:
        assert self.verifier is not None and self.verifier_inbox is not None
        round = request.next_round
        previous = self.verifier.outputs(request_id, round - 1)
        mask_id = self.drafter.args.mask_token_id
        tokens = mx.concatenate([previous.bonus.reshape(1), mx.full((block - 1,), mask_id, dtype=mx.int32)])[None]
        ctx_before = request.cache[0].length
        hidden = self.drafter.hidden(tokens, previous.taps, request.cache, keep=previous.keep)
        if block > 1:
            drafts = mx.argmax(self.drafter.logits(hidden[:, 1:]), axis=-1)[0].astype(mx.int32)
        else:
            drafts = mx.zeros((0,), dtype=mx.int32)
        ctx_after = request.cache[0].length
        request.outputs[round] = DraftOutputs(drafts, block, ctx_before, ctx_after)
        mx.async_eval(drafts, ctx_after)
        request.next_round += 1
        await self.verifier_inbox.send(Drafted(
            request_id=request_id, round=round, block_size=block,
            speculative=request.acked < round - 1, draft_queued_at=time.perf_counter(),
        ))
