"""The verifier: owns the target and every request's target KV cache.

Prefill computes the first token and the prompt's taps; each round verifies
``[anchor] + drafts`` in one target forward and queues the verdict, all lazily, so the
drafter can build the next round from the verdict before the host has read it. The
target KV's valid length advances on the device by ``a+1``; rejected positions lie past
it and are overwritten next round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import mlx.core as mx
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from protocol import ActorMessage, Admit, Drafted, GenerationParams, Prefilled, RoundAck, VerdictQueued, Verified
from runtime.acceptance import Verdict, verdict
from runtime.cache import DeviceKVCache
from runtime.models import DecoderModel
from runtime.plain import check_context
from runtime.sampling import Sampler, check_params

from .mailbox import DeviceStateOwner

if TYPE_CHECKING:
    from .drafter import Drafter


@dataclass
class RoundOutputs:
    """Device results of one round (or of the prefill, round -1), read by handle."""

    bonus: mx.array  # the next anchor
    taps: mx.array  # [1, rows, n_taps*H]
    keep: mx.array  # how many leading tap rows are accepted positions
    kv_before: mx.array
    kv_after: mx.array
    verdict: Verdict | None = None  # None for the prefill


@dataclass
class VerifierRequest:
    params: GenerationParams
    sampler: Sampler
    cache: list[DeviceKVCache]
    prompt_len: int
    outputs: dict[int, RoundOutputs] = field(default_factory=dict)


class Verifier(DeviceStateOwner[VerifierRequest]):
    name = "verifier"

    def __init__(self, target: DecoderModel, tap_layers: tuple[int, ...], inbox: ObjectReceiveStream[ActorMessage]) -> None:
        super().__init__(inbox)
        self.target, self.tap_layers = target, tap_layers
        self.committer: ObjectSendStream[ActorMessage] | None = None
        self.drafter_inbox: ObjectSendStream[ActorMessage] | None = None
        self.drafter: Drafter | None = None

    def outputs(self, request_id: str, round: int) -> RoundOutputs:
        return super().outputs(request_id, round)

    def has_round(self, request_id: str, round: int) -> bool:
        request = self.requests.get(request_id)
        return request is not None and round in request.outputs

    async def handle(self, message: ActorMessage) -> None:
        assert self.committer is not None and self.drafter_inbox is not None
        if isinstance(message, Admit):
            await self._prefill(message)
        elif isinstance(message, Drafted):
            if message.request_id in self.requests:
                await self._verify(message)
        elif isinstance(message, RoundAck):
            self._acknowledged(message)

    async def _prefill(self, message: Admit) -> None:
        assert self.committer is not None and self.drafter_inbox is not None
        check_params(message.params)
        check_context(self.target, len(message.prompt_ids), message.params.max_tokens)
        request = VerifierRequest(message.params, Sampler(message.params), self.target.make_device_cache(), len(message.prompt_ids))
        queued = time.perf_counter()
        out = self.target(mx.array([message.prompt_ids]), request.cache, tap_layers=self.tap_layers, last_only=True)
        assert out.taps is not None
        first = request.sampler.sample(out.logits[:, -1])[0].astype(mx.int32)
        prompt_len = mx.array(len(message.prompt_ids), dtype=mx.int32)
        for layer in request.cache:
            layer.advance(prompt_len)
            layer.settle(len(message.prompt_ids))
        request.outputs[-1] = RoundOutputs(first, out.taps, prompt_len, mx.array(0, dtype=mx.int32), prompt_len)
        mx.async_eval(first, out.taps)
        self.requests[message.request_id] = request
        await self.committer.send(Prefilled(request_id=message.request_id, queued_at=queued))
        await self.drafter_inbox.send(VerdictQueued(request_id=message.request_id, round=-1))

    async def _verify(self, message: Drafted) -> None:
        assert self.committer is not None and self.drafter_inbox is not None and self.drafter is not None
        request = self.requests[message.request_id]
        drafts = self.drafter.outputs(message.request_id, message.round).drafts
        anchor = request.outputs[message.round - 1].bonus
        kv_before = request.cache[0].length
        queued = time.perf_counter()
        tokens = mx.concatenate([anchor.reshape(1), drafts])[None]
        out = self.target(tokens, request.cache, tap_layers=self.tap_layers)
        assert out.taps is not None
        result = verdict(drafts, out.logits[0], request.params, request.sampler)
        keep = result.accepted + 1
        for layer in request.cache:
            layer.advance(keep)
        kv_after = request.cache[0].length
        request.outputs[message.round] = RoundOutputs(result.bonus, out.taps, keep, kv_before, kv_after, result)
        mx.async_eval(result.accepted, result.bonus, result.target_tokens, out.taps, kv_after)
        await self.committer.send(Verified(
            request_id=message.request_id, round=message.round, block_size=message.block_size,
            speculative=message.speculative, draft_queued_at=message.draft_queued_at, verify_queued_at=queued,
        ))
        await self.drafter_inbox.send(VerdictQueued(request_id=message.request_id, round=message.round))

    def _acknowledged(self, ack: RoundAck) -> None:
        request = self.requests.get(ack.request_id)
        if request is None:
            return
        if ack.finished:
            self.forget(ack.request_id)
            return
        if ack.round >= 0:
            for layer in request.cache:
                layer.settle(ack.target_kv)
        request.outputs.pop(ack.round - 1, None)  # the drafter has consumed it

