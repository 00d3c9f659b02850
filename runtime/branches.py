"""Verifying several drafted blocks a round and keeping the one the target accepts furthest.

A round drafts one block: the drafter's best token in every row, or the block copied from
the request's own text where the drafter does not find it unlikely (:func:`copy_preferred`,
runtime/lookup.py). Where the drafter's first choice is wrong the target often wanted a
runner-up (its misses sit where the target itself hesitates: docs/branches.md), and an
early miss costs most of the round. So a round can
draft ``branches`` blocks: its best, and copies of it with one row's token swapped for a
runner-up where the drafter's own probabilities expect the most gain (:func:`branch_drafts`),
verify them in one target forward, and keep the block accepted furthest (ties: the earlier
one), at no extra drafter forward.

The forward lays the blocks end to end; each continues the cache on its own: its rows
see the cache and their own block only (runtime.cache.causal_mask, the attention kernel's
``branch``) and are roped from the same position. Every block is thus verified exactly as
the target would verify it alone, the kept block's accepted drafts are the target's own
greedy tokens, and the output equals plain greedy decoding. The cache then keeps the kept
block's rows, moved to where a lone block's would be (:func:`keep_branch`).

More blocks need a greedy request and a DFlash 1 drafter (a DFlash 2 selector draws one
path): a sampled request's round verifies its first block, the one it would draft alone.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .cache import DeviceKVCache, KVCache, moved_index
from .models.steps import compiled_step

MAX_BRANCHES = 16
RANKS = 4  # a row's tokens a block may take: its best and three runner-ups
COPY_SHARE = 0.03  # a lone block is the copy unless the drafter expects it to run under this share of its own


def check_branches(branches: int) -> None:
    if not 1 <= branches <= MAX_BRANCHES:
        raise ValueError(f"branches must be 1 to {MAX_BRANCHES}, got {branches}")


def branch_drafts(logits: mx.array, branches: int, context: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """The blocks ``[R, branches, n]`` (int32) a round verifies, from the drafter's ``logits [R, n, V]``.

    Block 0 is the argmax of every row: the one block a round drafts alone. Each other block is
    that block with one row's token swapped for a runner-up, at the (row, runner-up) pairs the
    drafter's own probabilities expect to gain most: the chance its rows before are all right,
    times the runner-up's probability, times one plus the run expected after it.
    ``context``: each row's block copied from its own text and how many suffix tokens its
    occurrence matched (runtime.lookup.context_drafts). With several blocks, a copy that
    matched replaces the last swap; with one, it replaces the drafter's block where
    :func:`copy_preferred` says so.
    """
    if branches == 1 and context is None:
        return mx.argmax(logits, axis=-1).astype(mx.int32)[:, None]
    # some twenty ops: on a GPU, where each costs host time, one compiled step
    if context is None:
        return compiled_step(_drafter_blocks, branches=branches)(logits)
    return compiled_step(_with_copied, branches=branches)(logits, *context)


def _with_copied(logits: mx.array, copied: mx.array, matched: mx.array, branches: int) -> mx.array:
    if branches == 1:
        best = mx.argmax(logits, axis=-1).astype(mx.int32)
        return mx.where(copy_preferred(logits, best, copied, matched)[:, None], copied, best)[:, None]
    blocks = _drafter_blocks(logits, branches)
    last = mx.where((matched > 0)[:, None], copied, blocks[:, -1])
    return mx.concatenate([blocks[:, :-1], last[:, None]], axis=1)


def copy_preferred(logits: mx.array, best: mx.array, copied: mx.array, matched: mx.array) -> mx.array:
    """``[R]``: whether a round that verifies one block should verify the copied one rather than
    the drafter's ``best``: where the text's last token occurred before, unless the drafter's own
    probabilities (``logits [R, n, V]``) expect the copy to run less than :data:`COPY_SHARE` as far
    as its block. Chosen on the validation split from 2-block rounds, where both blocks'
    accepted lengths are known (docs/branches.md, "One block: the drafter's or the copy")."""
    probs = mx.softmax(logits.astype(mx.float32), axis=-1)
    return (matched > 0) & (expected_run(probs, copied) >= COPY_SHARE * expected_run(probs, best))


def expected_run(probs: mx.array, block: mx.array) -> mx.array:
    """``[R]``: the drafts of ``block [R, n]`` the verifier would accept, expected by ``probs [R, n, V]``
    taken as each row's chance of being right."""
    return mx.cumprod(mx.take_along_axis(probs, block[..., None], axis=-1)[..., 0], axis=1).sum(axis=1)


def _drafter_blocks(logits: mx.array, branches: int) -> mx.array:
    rows, n, _ = logits.shape
    swaps = min(branches - 1, n * (RANKS - 1))
    if swaps <= 0:
        best = mx.argmax(logits, axis=-1).astype(mx.int32)
        return mx.broadcast_to(best[:, None], (rows, branches, n))
    ranked = best_tokens(logits, RANKS)
    best = ranked[..., 0]
    probs = mx.take_along_axis(mx.softmax(logits.astype(mx.float32), axis=-1), ranked, axis=-1)
    log_best = mx.log(mx.maximum(probs[..., 0], 1e-9))
    held = mx.cumsum(log_best, axis=1)  # log P(rows 1..i all right)
    later = mx.arange(n)[None, :] > mx.arange(n)[:, None]
    run_after = mx.where(later, mx.exp(held[:, None, :] - held[:, :, None]), 0.0).sum(axis=-1)
    gain = (mx.exp(held - log_best) * (1.0 + run_after))[..., None] * probs[..., 1:]  # [R, n, RANKS-1]
    pick = mx.argsort(-gain.reshape(rows, -1), axis=-1)[:, :swaps]
    row, rank = pick // (RANKS - 1), pick % (RANKS - 1) + 1
    swapped = mx.take_along_axis(ranked.reshape(rows, -1), (row * RANKS + rank).astype(mx.int32), axis=1)
    blocks = mx.where(mx.arange(n) == row[..., None], swapped[..., None], best[:, None, :])
    # too few rows for that many swaps (a small block): block 0 again, which never wins a tie
    repeats = mx.broadcast_to(best[:, None], (rows, branches - 1 - swaps, n))
    return mx.concatenate([best[:, None], blocks, repeats], axis=1)


def best_tokens(logits: mx.array, count: int) -> mx.array:
    """``[..., count]``: each row's ``count`` likeliest tokens, best first (ties: the lower id).

    By repeated argmax rather than ``argpartition``: MLX's CUDA backend partitions by sorting
    the whole vocabulary (ml-explore/mlx#2302, #3064), a suspect in the draft's 4.2 -> 12.7 ms
    on an H100 when rounds verify two blocks (BENCHMARKS.md, session 31)."""
    vocab = mx.arange(logits.shape[-1])
    picks = []
    for _ in range(count):
        picks.append(mx.argmax(logits, axis=-1).astype(mx.int32))
        logits = mx.where(vocab == picks[-1][..., None], -mx.inf, logits)
    return mx.stack(picks, axis=-1)


def block_tokens(anchors: mx.array, drafts: mx.array) -> mx.array:
    """``[R, branches*W]``: every block ``[anchor] + drafts`` (``drafts [R, branches, W-1]``), end to end."""
    rows, branches, _ = drafts.shape
    anchor = mx.broadcast_to(anchors.astype(mx.int32)[:, None, None], (rows, branches, 1))
    return mx.concatenate([anchor, drafts.astype(mx.int32)], axis=2).reshape(rows, -1)


def kept_rows(rows: mx.array, branch: mx.array, width: int) -> mx.array:
    """Each row's ``width`` rows of its kept block: ``rows [R, branches*width, ...]``, ``branch [R]``."""
    r, total = rows.shape[:2]
    if total == width:
        return rows
    blocks = rows.reshape(r, total // width, width, *rows.shape[2:])
    index = branch.astype(mx.int32).reshape(r, 1, *([1] * (blocks.ndim - 2)))
    return mx.take_along_axis(blocks, index, axis=1)[:, 0]


def keep_branch(caches: Sequence[DeviceKVCache], start: mx.array, branch: mx.array, width: int) -> None:
    """After a verify of blocks of ``width`` rows written at ``start`` (``[R]`` or a scalar): every
    layer's rows of block ``branch`` moved to ``start``, where a lone block's would be.

    One gather a buffer, over one shared index; on a GPU, where each op costs host time, they
    run as one compiled step.
    """
    first = (start + branch * width).astype(mx.int32)
    buffers = [c.keys for c in caches] + [c.values for c in caches]
    moved = compiled_step(_moved_buffers, width=width)(first, start, *buffers)
    for i, cache in enumerate(caches):
        cache.keys, cache.values = moved[i], moved[len(caches) + i]


def _moved_buffers(first: mx.array, start: mx.array, *buffers: mx.array, width: int) -> list[mx.array]:
    # a model's layers are written the same rows, so their buffers share one capacity (as advance_layers relies on)
    index = moved_index(buffers[0].shape[2], first, start, width)
    return [mx.take_along_axis(buffer, index, axis=2) for buffer in buffers]


def keep_branch_host(caches: Sequence[KVCache], start: int, branch: int, width: int) -> None:
    """``keep_branch`` for the sequential loop's host-side caches: then only ``width`` rows stay written."""
    for cache in caches:
        cache.move_rows(start + branch * width, start, width)
        cache.offset = start + width
