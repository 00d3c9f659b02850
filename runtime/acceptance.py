"""Deciding how much of a drafted block the target accepts: all on the device.

Each function returns lazy arrays, so a pipelined caller can build the next round's
input from the verdict before the host has seen it. Greedy: accept while the draft
equals the target's argmax. Sampling (lossless, docs/decode-loop.md "Sampling", argmax proposals
with a one-hot q): accept draft d_i with probability p_i(d_i); at the first rejection
draw from p_i with d_i removed and renormalised; after a full accept draw the bonus from
the last row. Drafts drawn from a distribution q (a DFlash 2 selector at temperature > 0)
are accepted with probability min(1, p_i(d_i) / q_i(d_i)), and the first rejection draws
from max(p_i - q_i, 0) renormalised: rejection sampling, of which the one-hot case is the
special case q_i = onehot(d_i). All keep the committed tokens distributed exactly as the
target's.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import mlx.core as mx

from protocol import GenerationParams

from .sampling import Sampler, is_greedy, probabilities


class Verdict(NamedTuple):
    """``accepted`` drafts (a scalar), the ``bonus`` token, and the target's per-position tokens."""

    accepted: mx.array
    bonus: mx.array
    target_tokens: mx.array  # [n+1]: greedy argmax everywhere; sampled: valid up to accepted


def accepted_prefix(matches: mx.array) -> mx.array:
    """Length of the leading run of True."""
    if matches.size == 0:
        return mx.array(0, dtype=mx.int32)
    return mx.cumprod(matches.astype(mx.int32)).sum()


def greedy_verdict(drafts: mx.array, logits: mx.array) -> Verdict:
    """``drafts [n]`` against the target's ``logits [n+1, V]`` for ``[anchor] + drafts``."""
    rows = greedy_verdict_rows(drafts[None], logits[None], mx.array([drafts.shape[0]]))
    return Verdict(rows.accepted[0], rows.bonus[0], rows.target_tokens[0])


def sampled_verdict(drafts: mx.array, logits: mx.array, params: GenerationParams, sampler: Sampler,
                    draft_probs: mx.array | None = None) -> Verdict:
    """``draft_probs [n, V]``: the q each draft was drawn from (None: argmax drafts, q one-hot)."""
    probs = probabilities(logits, params)
    n, vocab = drafts.shape[0], probs.shape[-1]
    if n:
        p_of_draft = mx.take_along_axis(probs[:-1], drafts[:, None], axis=-1)[:, 0]
        if draft_probs is None:
            accepted = accepted_prefix(sampler.uniform((n,)) < p_of_draft)
        else:
            q_of_draft = mx.take_along_axis(draft_probs, drafts[:, None], axis=-1)[:, 0]
            accepted = accepted_prefix(sampler.uniform((n,)) * q_of_draft < p_of_draft)
    else:
        accepted = mx.array(0, dtype=mx.int32)
    padded = mx.concatenate([drafts.astype(mx.int32), mx.array([-1], dtype=mx.int32)])
    if draft_probs is None:
        rejected = padded[accepted]  # -1 after a full accept: nothing to remove
        row = mx.where(mx.arange(vocab) == rejected, 0.0, probs[accepted])
    else:
        row = _residual(probs[accepted], mx.concatenate([draft_probs, mx.zeros((1, vocab), draft_probs.dtype)])[accepted])
    bonus = sampler.draw(row / row.sum()).astype(mx.int32)
    target_tokens = mx.where(mx.arange(n + 1) < accepted, padded, bonus)
    return Verdict(accepted, bonus, target_tokens)


def _residual(p: mx.array, q: mx.array) -> mx.array:
    """max(p - q, 0), where a rejection draws from; p itself where that is all zero (p <= q
    everywhere: a rejection there has probability 0, the row just has to stay a distribution)."""
    row = mx.maximum(p - q, 0.0)
    return mx.where(row.sum() > 0, row, p)


def stacked_verdicts(drafts: mx.array, logits: mx.array, n_drafts: list[int], params: list[GenerationParams],
                     samplers: list[Sampler], draft_probs: Sequence[mx.array | None] | None = None) -> tuple[Verdict, mx.array]:
    """Verdicts of stacked requests, each verifying ``K`` blocks (runtime/branches.py): ``drafts
    [R, K, L-1]``, ``logits [R, K*L, V]`` (the blocks end to end); the verdict of the block each
    row keeps, and which one it is ``[R]``.

    Row r has ``n_drafts[r]`` real drafts a block (its own block size); the padding after them is
    never accepted. Greedy rows share one argmax and keep the block accepted furthest; a
    sampled row keeps its first block and draws alone with its own sampler, so it consumes its
    random stream exactly as when it runs by itself.
    ``draft_probs``: each row's q ``[>= n_drafts[r], V]`` where its drafts were sampled, else None.
    """
    greedy, kept = branch_verdict_rows(drafts, logits, mx.array(n_drafts))
    if all(is_greedy(p) for p in params):
        return greedy, kept
    width = drafts.shape[2] + 1
    rows, first = [], mx.array(0, dtype=mx.int32)
    for r, (n, p, sampler) in enumerate(zip(n_drafts, params, samplers)):
        if is_greedy(p):
            rows.append((greedy.accepted[r], greedy.bonus[r], greedy.target_tokens[r], kept[r]))
        else:
            q = draft_probs[r] if draft_probs is not None else None
            v = sampled_verdict(drafts[r, 0, :n], logits[r, : n + 1], p, sampler, None if q is None else q[:n])
            rows.append((v.accepted, v.bonus, mx.pad(v.target_tokens, (0, width - n - 1)), first))
    accepted, bonus, target_tokens, branch = (mx.stack(parts) for parts in zip(*rows))
    return Verdict(accepted, bonus, target_tokens), branch


def branch_verdict_rows(drafts: mx.array, logits: mx.array, n_drafts: mx.array) -> tuple[Verdict, mx.array]:
    """Greedy verdicts of ``K`` blocks a row (``drafts [R, K, L-1]``, ``logits [R, K*L, V]``): those
    of the block accepted furthest, the earliest of equals, and which one ``[R]``."""
    rows, k, n = drafts.shape
    blocks = greedy_verdict_rows(drafts.reshape(rows * k, n), logits.reshape(rows * k, n + 1, -1), mx.repeat(n_drafts, k))
    if k == 1:
        return blocks, mx.zeros((rows,), dtype=mx.int32)
    accepted = blocks.accepted.reshape(rows, k)
    # one maximum a row: further accepted first, then the earlier block
    kept = mx.argmax(accepted * k + (k - 1 - mx.arange(k)), axis=1).astype(mx.int32)
    pick = mx.arange(rows) * k + kept
    return Verdict(blocks.accepted[pick], blocks.bonus[pick], blocks.target_tokens[pick]), kept


def greedy_verdict_rows(drafts: mx.array, logits: mx.array, n_drafts: mx.array) -> Verdict:
    """``drafts [R, L-1]`` against ``logits [R, L, V]``; row r accepts at most ``n_drafts[r]``."""
    target_tokens = mx.argmax(logits, axis=-1).astype(mx.int32)
    real = mx.arange(drafts.shape[1])[None] < n_drafts[:, None]
    matches = (drafts == target_tokens[:, :-1]) & real
    accepted = mx.cumprod(matches.astype(mx.int32), axis=1).sum(axis=1)
    bonus = mx.take_along_axis(target_tokens, accepted[:, None], axis=1)[:, 0]
    return Verdict(accepted, bonus, target_tokens)
