"""Anchors, blocks, labels, loss weights and the attention mask of DFlash training.

For each sequence x (prompt + regenerated response) up to K anchors a are sampled in
the response with ``a + B <= len(x)``. Anchor a makes the block ``[x[a], MASK*(B-1)]``
at positions a..a+B-1, the block the decode loop would draft after committing x[a].

The two facts that make or break a drafter (DFLASH.md section 4):
- labels are same-position: block row k predicts ``x[a + k]``, and row 0 predicts nothing;
- a block sees target features strictly before its anchor (``kv < a``): at decode time
  the anchor is the newest committed token, whose features do not exist yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from .data import Example

PAD_ID = 0  # any id of the vocabulary: padded positions are masked out of loss and attention
# The attention's key count (context + blocks) is padded to a multiple of this: a compiled
# step then meets few distinct shapes, and MLX's CUDA attention gradient (mlx 0.32.4, seen
# on an H200) gives wrong values, then illegal memory accesses, for other key counts.
KEY_MULTIPLE = 128
DFLASH_GAMMAS = {16: 7.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """DFlash's loss decay for B=16 and B=8; B/2 (between the two) for other sizes."""
    return DFLASH_GAMMAS.get(block_size, block_size / 2)


def loss_weights(block_size: int, gamma: float) -> np.ndarray:
    """``exp(-(k-1)/gamma)`` for block rows k = 1..B-1: early drafts matter most."""
    k = np.arange(1, block_size)
    return np.exp(-(k - 1) / gamma).astype(np.float32)


def candidate_anchors(prompt_len: int, length: int, block_size: int) -> np.ndarray:
    """Every anchor in the response with a whole block inside x, in order."""
    return np.arange(prompt_len, length - block_size + 1)


def sample_anchors(prompt_len: int, length: int, block_size: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``count`` distinct anchors in the response, each with a whole block inside x."""
    candidates = candidate_anchors(prompt_len, length, block_size)
    if len(candidates) > count:
        candidates = np.sort(rng.choice(candidates, size=count, replace=False))
    return candidates


def decoded_rounds(hits: np.ndarray) -> np.ndarray:
    """Indices of the anchors a decode meets, from a drafter's hits ``[A, B-1]`` at consecutive anchors.

    On the target's own greedy sequence, a round anchored at ``a`` whose first ``n`` drafts are
    right delivers them and the target's token ``x[a+n+1]``, which anchors the next round. So
    rounds mostly start just past a miss, where drafting is hardest, and not where uniform
    anchors fall: tau is decided at these anchors."""
    runs, met, i = leading_hits(hits), [], 0
    while i < len(hits):
        met.append(i)
        i += int(runs[i]) + 1
    return np.asarray(met, dtype=np.int64)


def leading_hits(hits: np.ndarray) -> np.ndarray:
    """Each block's accepted drafts under greedy verification: the leading run of its hits ``[..., B-1]``."""
    return np.cumprod(hits, axis=-1).sum(axis=-1)


def spread(values: np.ndarray, count: int) -> np.ndarray:
    """At most ``count`` of ``values``, evenly spaced over them."""
    if len(values) <= count:
        return values
    return values[np.linspace(0, len(values) - 1, count).round().astype(np.int64)]


def block_labels(tokens: Sequence[int], anchors: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Same-position labels ``x[a+k]`` for k = 1..B-1, and where they exist (``a+k < len``)."""
    positions = anchors[:, None] + np.arange(1, block_size)[None, :]
    valid = positions < len(tokens)
    labels = np.asarray(tokens)[np.minimum(positions, len(tokens) - 1)]
    return np.where(valid, labels, PAD_ID), valid


def training_mask(anchors: mx.array, ctx_len: int, block_size: int, lengths: mx.array | None = None) -> mx.array:
    """Which keys ``[ctx (ctx_len) ; all blocks]`` each block query sees: ``[S, 1, K*B, ctx_len + K*B]``.

    Context position j is visible to a block at anchor a iff ``j < a`` (never its own
    anchor's features); within its own block a query sees every row (bidirectional);
    it never sees another block. ``lengths [S, K]``: a block of length L < B has only its
    first L rows, so no query sees the rows past them (they are not supervised either):
    it is trained as the decode loop drafts a block of L.
    """
    s, k = anchors.shape
    query_anchor = mx.repeat(anchors, block_size, axis=1)  # [S, K*B]: each row's block anchor
    sees_context = mx.arange(ctx_len)[None, None, :] < query_anchor[:, :, None]
    block_of = mx.arange(k * block_size) // block_size
    sees_own_block = mx.broadcast_to(block_of[:, None] == block_of[None, :], (s, k * block_size, k * block_size))
    if lengths is not None:
        present = (mx.arange(k * block_size) % block_size)[None, :] < mx.repeat(lengths, block_size, axis=1)
        sees_own_block = sees_own_block & present[:, None, :]
    return mx.concatenate([sees_context, sees_own_block], axis=-1)[:, None]


def sample_lengths(count: int, block_sizes: Sequence[int], block_size: int, rng: np.random.Generator) -> np.ndarray:
    """Each of ``count`` blocks' length: one of ``block_sizes`` at random, or all ``block_size``."""
    if not block_sizes:
        return np.full(count, block_size, dtype=np.int32)
    return rng.choice(np.asarray(block_sizes, dtype=np.int32), size=count)


@dataclass
class MicroBatch:
    tokens: mx.array  # [S, T] whole sequences, right-padded: the target's input
    blocks: mx.array  # [S, K*B] each anchor's block [x[a], MASK*(B-1)], end to end
    anchors: mx.array  # [S, K]; padding blocks sit at 0 with zero weight
    lengths: mx.array  # [S, K]: each block's rows (B, or fewer when training for shorter blocks)
    labels: mx.array  # [S, K, B-1]: x[a+k] for k = 1..B-1
    weights: mx.array  # [S, K, B-1]: the loss weight, 0 where there is no label
    real_tokens: int  # sequence tokens before padding (for throughput)


def padded_context(length: int, block_rows: int) -> int:
    """The context length to pad to: at least ``length``, with context + block rows a multiple."""
    keys = -(-(length + block_rows) // KEY_MULTIPLE) * KEY_MULTIPLE
    return keys - block_rows


def make_micro_batch(
    examples: Sequence[Example], anchor_lists: Sequence[np.ndarray], blocks_per_seq: int,
    block_size: int, mask_token_id: int, gamma: float, length_lists: Sequence[np.ndarray] | None = None,
) -> MicroBatch:
    """Stack sequences and their anchors; every sequence gets ``blocks_per_seq`` blocks.

    ``length_lists``: each anchor's block length (default ``block_size``); rows past it get
    no loss (and ``training_mask`` hides them)."""
    s, b, k = len(examples), block_size, blocks_per_seq
    tokens = np.full((s, padded_context(max(len(e) for e in examples), k * b)), PAD_ID, dtype=np.int32)
    anchors = np.zeros((s, k), dtype=np.int32)
    lengths = np.full((s, k), b, dtype=np.int32)
    labels = np.full((s, k, b - 1), PAD_ID, dtype=np.int32)
    weights = np.zeros((s, k, b - 1), dtype=np.float32)
    blocks = np.full((s, k, b), mask_token_id, dtype=np.int32)
    row_weights = loss_weights(b, gamma)
    for i, (example, picked) in enumerate(zip(examples, anchor_lists)):
        seq = example.tokens
        tokens[i, : len(seq)] = seq
        n = len(picked)
        anchors[i, :n] = picked
        blocks[i, :n, 0] = np.asarray(seq)[picked]
        labels[i, :n], valid = block_labels(seq, picked, b)
        if length_lists is not None:
            lengths[i, :n] = length_lists[i]
        present = np.arange(1, b)[None, :] < lengths[i, :n, None]
        weights[i, :n] = np.where(valid & present, row_weights, 0.0)
    return MicroBatch(
        tokens=mx.array(tokens), blocks=mx.array(blocks.reshape(s, k * b)), anchors=mx.array(anchors),
        lengths=mx.array(lengths),
        labels=mx.array(labels), weights=mx.array(weights), real_tokens=sum(len(e) for e in examples),
    )
