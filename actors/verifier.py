"""The verifier: owns the target and every request's target KV cache.

Prefill computes the first token and the prompt's taps; each round verifies
``[anchor] + drafts`` in one target forward and queues the verdict, all lazily, so the
drafter can build the next round from the verdict before the host has read it. The
target KV's valid length advances on the device by ``a+1``; rejected positions lie past
it and are overwritten next round.

A round may verify several drafted blocks (runtime/branches.py): they go end to end into the
same forward, and the cache and the taps keep the block accepted furthest.

Rounds of many requests are verified together: at each flush every drafted round
waiting here goes into one target forward (when the mode's schedule lets them:
``Schedule.verify_step``, actors/schedule.py) over their stacked caches (each row at its
own KV length and positions), padded to the longest block; a row never accepts past
its own block. The stack is kept from step to step while the same requests are verified
together (stacking copies every buffer and unstacking makes a view per row and layer:
ops that cost host time on a GPU); they get their rows back when it breaks up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from protocol import (
    ActorMessage,
    Admit,
    Cancelled,
    Drafted,
    GenerationParams,
    Prefilled,
    RoundAck,
    VerdictQueued,
    Verified,
)
from runtime.acceptance import stacked_verdicts
from runtime.batching import HostReadout, default_pad_batches, pad_rows, padded, padded_batch
from runtime.branches import block_tokens, keep_branch, kept_rows
from runtime.cache import DeviceKVCache, KeptStack, advance_layers
from runtime.models import DecoderModel
from runtime.plain import check_context
from runtime.sampling import Sampler, check_params

from .mailbox import DeviceStateOwner, Inbox, Outbox, send_burst, send_soon
from .rounds import DraftOutputs, RoundOutputs, RoundReader, RoundResults, VerifiedRow, VerifyStep, stacked_rows
from .schedule import NONE, PREFILL, Schedule


__all__ = ["RoundOutputs", "VerifiedRow", "Verifier"]


@dataclass
class VerifierRequest:
    params: GenerationParams
    sampler: Sampler
    cache: list[DeviceKVCache]
    prompt_len: int
    acked: int = NONE  # latest round the committer acknowledged (-1: the prefill's first token)


class Verifier(DeviceStateOwner[VerifierRequest, RoundOutputs]):
    """Reads Admit, Drafted, RoundAck and Cancelled; sends Prefilled and Verified to the committer,
    VerdictQueued to the drafter.

    ``drafts``: the drafter's round results, by handle (the drafts verified).
    """

    name = "verifier"

    def __init__(self, target: DecoderModel, tap_layers: tuple[int, ...], schedule: Schedule, inbox: Inbox, *,
                 drafts: RoundReader[DraftOutputs], drafter: Outbox, committer: Outbox,
                 results: RoundResults[RoundOutputs] | None = None, pad_batches: bool | None = None) -> None:
        super().__init__(inbox, failures=committer, results=results)
        self.target, self.tap_layers, self.schedule = target, tap_layers, schedule
        self.pad_batches = default_pad_batches() if pad_batches is None else pad_batches
        self.drafts = drafts
        self.drafter, self.committer = drafter, committer
        self._admitted: list[Admit] = []
        self._drafted: dict[str, Drafted] = {}  # request id -> its round waiting to be verified
        self._stack = KeptStack()

    async def handle(self, message: ActorMessage) -> None:
        if isinstance(message, Admit):
            self._admitted.append(message)
        elif isinstance(message, Drafted):
            if message.request_id in self.requests:
                self._drafted[message.request_id] = message
        elif isinstance(message, Cancelled):
            self.forget(message.request_id)  # also a request admitted but not prefilled yet
        elif isinstance(message, RoundAck):
            self._acknowledged(message)

    def forget(self, request_id: str) -> None:
        self._stack.drop(request_id)
        super().forget(request_id)
        self._drafted.pop(request_id, None)
        self._admitted = [a for a in self._admitted if a.request_id != request_id]  # not prefilled yet

    async def flush(self) -> None:
        admitted, self._admitted = self._admitted, []
        for admit in admitted:
            await self._isolated(admit.request_id, self._prefill, admit)
        drafted = {rid: m for rid, m in self._drafted.items() if rid in self.requests}
        if not self.schedule.verify_step({rid: m.round for rid, m in drafted.items()},
                                         {rid: self.requests[rid].acked for rid in drafted}):
            return
        self._drafted = {}
        await self.run_batch(list(drafted), lambda ids: self._verify([drafted[rid] for rid in ids]))

    async def _prefill(self, message: Admit) -> None:
        check_params(message.params)
        check_context(self.target, len(message.prompt_ids), message.params.max_tokens)
        request = VerifierRequest(message.params, Sampler(message.params), self.target.make_device_cache(), len(message.prompt_ids))
        queued = time.perf_counter()
        out = self.target.prefill(message.prompt_ids, request.cache, self.tap_layers)
        assert out.taps is not None
        first = request.sampler.sample(out.logits[:, -1])[0].astype(mx.int32)
        prompt_len = request.cache[0].length
        zero = mx.array([0], dtype=mx.int32)
        readout = HostReadout([zero, first.reshape(1), prompt_len.reshape(1), zero, prompt_len.reshape(1), zero])
        step = VerifyStep(first.reshape(1), out.taps, prompt_len.reshape(1), first.reshape(1, 1), readout)
        self.results.put(message.request_id, PREFILL, RoundOutputs(step, 0, 0))
        mx.async_eval(readout.packed, out.taps)
        self.requests[message.request_id] = request
        await send_soon(self.committer, Prefilled(request_id=message.request_id, queued_at=queued))
        await send_soon(self.drafter, VerdictQueued(request_id=message.request_id, round=PREFILL))

    async def _verify(self, rounds: Sequence[Drafted]) -> None:
        """One target forward for the given rounds of different requests (plus blank padding rows)."""
        rounds = self._in_batch_order(rounds)
        requests = [self.requests[m.request_id] for m in rounds]
        blocks = [m.block_size for m in rounds]
        n = len(rounds)
        rows = padded_batch(n) if self.pad_batches else n
        queued = time.perf_counter()
        outputs = [self.drafts.get(m.request_id, m.round) for m in rounds]
        drafts = self._drafts_at_widest(outputs, rows)
        branches, width = drafts.shape[1], drafts.shape[2] + 1
        anchors = stacked_rows([(p.step.bonus, p.row) for p in
                                (self.results.get(m.request_id, m.round - 1) for m in rounds)], rows)
        with self._stack.stacked([m.request_id for m in rounds], [r.cache for r in requests], branches * width, rows) as caches:
            start = caches[0].length
            kv_before = start.reshape(-1)[:n]
            out = self.target(block_tokens(anchors, drafts), caches, tap_layers=self.tap_layers, branch=width)
            assert out.taps is not None
            verdict, branch = stacked_verdicts(drafts[:n], out.logits[:n], [b - 1 for b in blocks],
                                               [r.params for r in requests], [r.sampler for r in requests],
                                               [o.probs for o in outputs])
            taps = out.taps
            if branches > 1:  # one block: its rows are already where they belong
                every_branch = padded(branch, rows)
                taps = kept_rows(out.taps, every_branch, width)
                keep_branch(caches, start, every_branch if rows > 1 else every_branch[0], width)
            keep = verdict.accepted + 1
            kept = padded(keep, rows)
            advance_layers(caches, kept if rows > 1 else kept[0])
            kv_after = caches[0].length.reshape(-1)[:n]
        readout = HostReadout([verdict.accepted, verdict.bonus, keep, kv_before, kv_after, branch, verdict.target_tokens])
        step = VerifyStep(verdict.bonus, taps, keep, verdict.target_tokens, readout)
        for row, (message, block) in enumerate(zip(rounds, blocks)):
            self.results.put(message.request_id, message.round, RoundOutputs(step, row, block))
        mx.async_eval(readout.packed, taps)
        await send_burst(self.committer, [Verified(
            request_id=m.request_id, round=m.round, block_size=m.block_size, speculative=m.speculative,
            draft_queued_at=m.draft_queued_at, verify_queued_at=queued, batch_size=n) for m in rounds])
        await send_burst(self.drafter, [VerdictQueued(request_id=m.request_id, round=m.round) for m in rounds])

    @staticmethod
    def _drafts_at_widest(outputs: Sequence[DraftOutputs], rows: int) -> mx.array:
        """``[rows, K, width-1]``: the rounds' blocks at the batch's widest block (a request's smaller
        block, from its params, keeps the shape), zero rows after them."""
        widths = {o.step.drafts.shape[2] for o in outputs}
        if len(widths) == 1:
            return stacked_rows([(o.step.drafts, o.row) for o in outputs], rows)
        blank = mx.zeros((outputs[0].step.drafts.shape[1], 0), dtype=mx.int32)
        return pad_rows([o.drafts for o in outputs] + [blank] * (rows - len(outputs)), max(widths), axis=1)

    def _in_batch_order(self, rounds: Sequence[Drafted]) -> list[Drafted]:
        """The rounds in the kept stack's row order when they are its requests (else as they came)."""
        if {m.request_id for m in rounds} != set(self._stack.ids):
            return list(rounds)
        row = {rid: i for i, rid in enumerate(self._stack.ids)}
        return sorted(rounds, key=lambda m: row[m.request_id])

    @property
    def cache_bytes(self) -> int:
        return super().cache_bytes + self._stack.nbytes

    def _acknowledged(self, ack: RoundAck) -> None:
        if ack.finished:
            self.forget(ack.request_id)  # also a request admitted but not prefilled yet
            return
        request = self.requests.get(ack.request_id)
        if request is None:
            return
        request.acked = ack.round
        if ack.round > PREFILL:
            for layer in request.cache:
                layer.settle(ack.target_kv)
        self.results.pop(ack.request_id, ack.round - 1)  # the drafter has consumed it
