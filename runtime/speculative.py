"""DFlash speculative decoding for one request: the sequential reference loop.

Per round (docs/decode-loop.md, "Decode loop"): the drafter proposes ``B-1`` tokens for the block
``[anchor, MASK...]``, the target verifies ``[anchor] + drafts`` in one forward, the
verdict accepts a prefix of ``a`` drafts plus the target's bonus token, the target KV
drops the ``B-a-1`` rejected positions and the drafter receives the ``a+1`` accepted
feature rows as new context. The host syncs once per round here; the actor pipeline
(actors/) runs the same steps without waiting.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import mlx.core as mx

from protocol import GenerationParams

from .acceptance import Verdict, stacked_verdicts
from .branches import block_tokens, check_branches, keep_branch_host, kept_rows
from .cache import KVCache, cache_length, trim_caches
from .errors import RequestError
from .invariants import RoundAuditor, RoundFacts
from .lookup import TokenHistory
from .models import DecoderModel
from .models.dflash import DFlashDrafter, Proposal
from .plain import check_context
from .sampling import Sampler, check_params, is_greedy
from .stopping import Emission, TextStream, delivered_tokens
from .tokenizer import Tokenizer


def draft_sampler(drafter: DFlashDrafter, params: GenerationParams) -> Sampler | None:
    """The sampler of the drafter's own draws for a request: a DFlash 2 selector at temperature > 0
    samples its path (on a stream apart from the verifier's); else None, drafts are the argmax."""
    if drafter.selector is None or is_greedy(params):
        return None
    return Sampler(params, drafts=True)


def propose_drafts(drafter: DFlashDrafter, hidden: mx.array, anchors: mx.array, samplers: Sequence[Sampler | None],
                   blocks: Sequence[int], branches: int = 1, context: tuple[mx.array, mx.array] | None = None) -> Proposal:
    """The drafts of stacked blocks from the drafter's rows 1.. (``hidden [R, n, H]``, post-norm),
    ``branches`` blocks a row, one of them copied from the row's own text where ``context`` has
    one (runtime/branches.py, runtime/lookup.py).

    The one place drafts come from, for the engine's drafter actor and this module's loop.
    Row r < len(samplers) belongs to a request whose block is ``blocks[r]``; a row with a
    sampler draws its path (DFlash 2 at temperature > 0) from noise of its own block's
    shape, so it drafts the same in any batch; other rows (and blank padding) are greedy.
    """
    if all(s is None for s in samplers):
        return drafter.propose(hidden, anchors, branches=branches, context=context)
    assert drafter.selector is not None
    rows, n = hidden.shape[:2]
    k = drafter.selector.top_k
    noise = [mx.pad(s.gumbel((b - 1, k)), [(0, n - b + 1), (0, 0)]) if s is not None else mx.zeros((n, k))
             for s, b in zip(samplers, blocks)]
    noise += [mx.zeros((n, k))] * (rows - len(noise))
    temperatures = [s.params.temperature if s is not None else 1.0 for s in samplers]
    temperatures += [1.0] * (rows - len(temperatures))
    return drafter.propose(hidden, anchors, mx.array(temperatures, dtype=mx.float32), mx.stack(noise), branches, context)


def block_size_for(drafter: DFlashDrafter, params: GenerationParams) -> int:
    """The request's block size: its own choice up to the drafter's trained size."""
    size = params.block_size or drafter.block_size
    if size > drafter.block_size:
        raise RequestError("block_size", f"{size} exceeds the drafter's trained block size {drafter.block_size}")
    return size


@dataclass
class RequestState:
    """Everything one request keeps on the device between rounds."""

    target_cache: list[KVCache]
    drafter_cache: list[KVCache]
    pending_ctx: mx.array  # [1, rows, n_taps*H]: accepted features not yet in the drafter cache
    anchor: int
    committed: int  # prompt + generated tokens
    history: TokenHistory | None  # those tokens on the device, where the drafter copies blocks (runtime/lookup.py)

    @property
    def target_kv(self) -> int:
        return cache_length(self.target_cache)

    @property
    def drafter_ctx(self) -> int:
        return cache_length(self.drafter_cache)


@dataclass
class RoundOutcome:
    facts: RoundFacts
    timings: dict[str, float] = field(default_factory=dict)
    delivered: int = 0  # committed tokens the stream took: a last round's past max_tokens are not


class SpeculativeDecoder:
    """Prefill and rounds for one request over a bound target/drafter pair, each round verifying
    ``branches`` blocks (runtime/branches.py)."""

    def __init__(self, target: DecoderModel, drafter: DFlashDrafter, params: GenerationParams, branches: int = 1) -> None:
        check_branches(branches)
        self.target, self.drafter, self.params, self.branches = target, drafter, params, branches
        self.sampler = Sampler(params)
        self.draft_sampler = draft_sampler(drafter, params)
        self.block = block_size_for(drafter, params)
        self.auditor: RoundAuditor | None = None

    def prefill(self, prompt_ids: Sequence[int]) -> tuple[RequestState, int]:
        cache = self.target.make_cache()
        out = self.target(mx.array([list(prompt_ids)]), cache, tap_layers=self.drafter.tap_layers, last_only=True)
        first = self.sampler.sample(out.logits[:, -1])
        assert out.taps is not None
        mx.eval(first, out.taps)
        token = int(first.item())
        history = TokenHistory.for_request([*prompt_ids, token], self.params.max_tokens, self.block) \
            if self.drafter.copies_blocks else None
        state = RequestState(cache, self.drafter.make_cache(), out.taps, token, len(prompt_ids) + 1, history)
        self.auditor = RoundAuditor(len(prompt_ids), len(self.drafter.tap_layers), self.target.args.hidden_size)
        return state, token

    def draft(self, state: RequestState, block: int) -> Proposal:
        """``branches`` blocks of ``block-1`` drafted tokens ``[1, K, block-1]`` (and their q where
        sampled); the pending context enters the drafter cache."""
        tokens = mx.array([[state.anchor] + [self.drafter.args.mask_token_id] * (block - 1)])
        hidden = self.drafter.hidden(tokens, state.pending_ctx, state.drafter_cache)
        if block == 1:
            return Proposal(mx.zeros((1, self.branches, 0), dtype=mx.int32), None)
        context = state.history.drafts(block - 1) if state.history is not None else None
        return propose_drafts(self.drafter, hidden[:, 1:], mx.array([state.anchor]), [self.draft_sampler], [block],
                              self.branches, context)

    def verify(self, state: RequestState, proposal: Proposal) -> tuple[Verdict, mx.array, mx.array]:
        """The verdict of the block kept, which one it is, and its taps ``[1, block, F]``; the
        target cache holds the kept block's rows where a lone block's would be."""
        drafts = proposal.tokens
        width = drafts.shape[2] + 1
        start = state.target_kv
        out = self.target(block_tokens(mx.array([state.anchor]), drafts), state.target_cache,
                          tap_layers=self.drafter.tap_layers, branch=width)
        assert out.taps is not None
        result, kept = stacked_verdicts(drafts, out.logits, [width - 1], [self.params], [self.sampler],
                                        [None if proposal.probs is None else proposal.probs[0]])
        if self.branches > 1:
            keep_branch_host(state.target_cache, start, int(kept.item()), width)
        return Verdict(result.accepted[0], result.bonus[0], result.target_tokens[0]), kept[0], kept_rows(out.taps, kept, width)

    def round(self, state: RequestState, index: int) -> RoundOutcome:
        """One sequential round at the whole block, even near max_tokens (the stream trims past it),
        as the engine drafts: every mode then drafts the same rounds."""
        block = self.block
        kv_before, ctx_before, committed_before = state.target_kv, state.drafter_ctx, state.committed
        t0 = time.perf_counter()
        proposal = self.draft(state, block)
        mx.eval(proposal.tokens)
        t1 = time.perf_counter()
        result, kept, taps = self.verify(state, proposal)
        mx.eval(result.accepted, result.bonus, result.target_tokens, taps)
        t2 = time.perf_counter()
        a, branch = int(result.accepted.item()), int(kept.item())
        draft_list = proposal.tokens[0, branch].tolist()
        committed = draft_list[:a] + [int(result.bonus.item())]
        trim_caches(state.target_cache, block - a - 1)
        state.pending_ctx = taps[:, : a + 1]
        state.anchor = committed[-1]
        if state.history is not None:
            state.history.extend(committed, state.committed)
        state.committed += len(committed)
        facts = RoundFacts(
            round=index, anchor_pos=kv_before, block_size=block, drafts=draft_list,
            target_tokens=result.target_tokens.tolist()[: len(draft_list) + 1], accepted=a,
            committed=committed, committed_before=committed_before, target_kv_before=kv_before,
            target_kv_after=state.target_kv, drafter_ctx_before=ctx_before,
            drafter_ctx_after=state.drafter_ctx, new_ctx_rows=int(state.pending_ctx.shape[1]),
            tap_shape=tuple(taps.shape[1:]), greedy=is_greedy(self.params), branch=branch,
        )
        assert self.auditor is not None, "prefill() first"
        self.auditor.check(facts)
        t3 = time.perf_counter()
        return RoundOutcome(facts, {"draft_s": t1 - t0, "verify_s": t2 - t1, "host_s": t3 - t2})


@dataclass
class SpeculativeStats:
    rounds: list[RoundOutcome] = field(default_factory=list)

    def summary(self, block: int) -> dict[str, object]:
        accepted = [r.facts.accepted for r in self.rounds]
        n = len(accepted)
        per_position = [sum(a >= k for a in accepted) / n if n else 0.0 for k in range(1, block)]
        return {
            "rounds": n,
            "tau": (sum(r.delivered for r in self.rounds) / n) if n else 0.0,
            "acceptance_per_position": [round(x, 4) for x in per_position],
        }


def generate_speculative(
    target: DecoderModel, drafter: DFlashDrafter, tokenizer: Tokenizer, prompt_ids: Sequence[int],
    params: GenerationParams, stats: SpeculativeStats | None = None,
    on_round: Callable[[RoundOutcome], None] | None = None, branches: int = 1,
) -> Iterator[Emission]:
    """Stream emissions of DFlash decoding until EOS, a stop string or max_tokens, each round
    verifying ``branches`` blocks (runtime/branches.py)."""
    check_params(params)
    check_context(target, len(prompt_ids), params.max_tokens)
    decoder = SpeculativeDecoder(target, drafter, params, branches)
    stream = TextStream(tokenizer, params.max_tokens, params.stop)
    state, first = decoder.prefill(prompt_ids)
    emission = stream.push([first])
    yield emission
    index = 0
    while emission.finish_reason is None:
        outcome = decoder.round(state, index)
        outcome.delivered = delivered_tokens(len(outcome.facts.committed), stream.remaining)
        if stats is not None:
            stats.rounds.append(outcome)
        if on_round is not None:
            on_round(outcome)
        emission = stream.push(outcome.facts.committed)
        yield emission
        index += 1
