"""A drafted block copied from the request's own text: what followed the latest earlier
occurrence of the text's last tokens.

Generated text repeats itself: code reuses its names and lines, a worked answer restates the
question's numbers, a small model falls into loops. Where it does, the tokens that followed
the last time the current suffix occurred predict the next ones better than a drafter that
sees each round afresh. Such a block is one more candidate for a round that verifies several,
and a round that verifies one verifies it instead of the drafter's where the drafter does not
find it unlikely (runtime/branches.py). It costs the drafter nothing, and the verifier accepts
only what the target itself would have produced, so the output stays the target's own
(docs/branches.md).

Everything here runs on the device over fixed shapes, so the pipelined engine's drafter can
copy round N+1's block from round N's verdict before the host has read it.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from .models.steps import compiled_step

MAX_MATCH = 8  # suffix tokens compared: the longest match wins, a longer one rarely changes the pick
CAPACITY_STEP = 256  # histories' lengths on the device, rounded up to a multiple of it


def context_drafts(history: mx.array, length: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """:func:`copied_block`, as one compiled step on a GPU (some seventy ops eager, each costing host time
    there). The history is padded to a rounded capacity first: a compiled step is traced again
    for every new shape, and on a GPU a trace builds kernels for seconds."""
    return compiled_step(copied_block, n=n)(padded_to(history, rounded_capacity(history.shape[1])), length)


def padded_to(tokens: mx.array, length: int) -> mx.array:
    """``tokens`` padded with zeros along their last axis to ``length``; as they are where they
    already fill it, since a pad even of nothing is a copy on the device."""
    extra = length - tokens.shape[-1]
    return tokens if extra == 0 else mx.pad(tokens, [(0, 0)] * (tokens.ndim - 1) + [(0, extra)])


def rounded_capacity(tokens: int) -> int:
    """A history's length on the device: a multiple of :data:`CAPACITY_STEP`, so few shapes."""
    return -(-tokens // CAPACITY_STEP) * CAPACITY_STEP


def copied_block(history: mx.array, length: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """Each row's ``n`` next tokens as its text went on after the latest earlier occurrence of
    its longest suffix (up to :data:`MAX_MATCH` tokens), and whether one occurred.

    ``history [R, C]`` (int32) holds each row's tokens so far, ``length [R]`` how many (at
    least one; positions past it are ignored). A continuation that runs into the suffix itself
    repeats with its period, as a loop would. Returns ``(tokens [R, n] int32, matched [R] int32)``:
    ``matched`` is how many suffix tokens the occurrence matched, 0 where none occurred (the
    row then gets its last token repeated).
    """
    capacity = history.shape[1]
    positions = mx.arange(capacity)[None]
    last = (length.astype(mx.int32) - 1)[:, None]  # [R, 1]: the latest token's position
    back = mx.arange(MAX_MATCH)  # i: tokens back from an occurrence's end, and from the suffix's
    # every shift at once rather than a loop over them: on a GPU each op costs host time
    padded = mx.pad(history.astype(mx.int32), [(0, 0), (MAX_MATCH, 0)], constant_values=-1)
    earlier = mx.take(padded, positions - back[:, None] + MAX_MATCH, axis=1)  # [R, i, s]: the token at s - i
    suffix = mx.take_along_axis(history, mx.maximum(last - back, 0), axis=1)  # [R, i]: the token at last - i
    equal = (earlier == suffix[..., None]) & (last - back >= 0)[..., None] & (positions < last)[:, None]
    matched = mx.cumprod(equal.astype(mx.int32), axis=1).sum(axis=1)  # [R, s]: tokens ending at s equal to the suffix
    best = mx.argmax(matched * capacity + positions, axis=1)  # the longest, then the latest
    length_matched = mx.take_along_axis(matched, best[:, None], axis=1)[:, 0]
    found = length_matched > 0
    period = mx.maximum(last[:, 0] - best, 1)
    index = best[:, None] + 1 + mx.arange(n)[None] % period[:, None]
    index = mx.where(found[:, None], index, last)
    return mx.take_along_axis(history, index.astype(mx.int32), axis=1).astype(mx.int32), length_matched


class TokenHistory:
    """A request's tokens on the device, appended round by round from the verdicts on the device,
    so a block can be copied from them before the host has read a round (the engine's drafter)."""

    def __init__(self, prompt_ids: Sequence[int], capacity: int) -> None:
        """``capacity``: the most tokens it will hold, plus a block's worth of slack a round writes past them."""
        if capacity < len(prompt_ids):
            raise ValueError(f"capacity {capacity} < the prompt's {len(prompt_ids)} tokens")
        capacity = rounded_capacity(capacity)
        self.tokens = mx.array([*prompt_ids, *[0] * (capacity - len(prompt_ids))], dtype=mx.int32)
        self.length = mx.array(len(prompt_ids), dtype=mx.int32)

    @classmethod
    def for_request(cls, prompt_ids: Sequence[int], max_tokens: int, block: int) -> TokenHistory:
        """Room for a request's whole text: rounds drafted ahead of the last verdict read, and a last
        round's whole block, may append past ``max_tokens``, so a few blocks more."""
        return cls(prompt_ids, len(prompt_ids) + max_tokens + 4 * block)

    def extend(self, tokens: Sequence[int], length: int) -> None:
        """``tokens`` the host has read, after the first ``length`` (the sequential loop): only they
        travel to the device, not the whole history again."""
        self.tokens[length : length + len(tokens)] = mx.array(tokens, dtype=mx.int32)
        self.length = mx.array(length + len(tokens), dtype=mx.int32)

    def drafts(self, n: int) -> tuple[mx.array, mx.array]:
        """:func:`context_drafts` of this history alone: ``([1, n] tokens, [1] matched)``."""
        return context_drafts(self.tokens[None], self.length[None], n)


def histories_drafts(histories: Sequence[TokenHistory], tokens: mx.array, counts: mx.array,
                     n: int) -> tuple[mx.array, mx.array]:
    """:func:`context_drafts` of stacked requests' histories after each appends the first
    ``counts [R]`` of its ``tokens [R, W]`` (the rest land past its end, where the next go)."""
    capacity = max(h.tokens.shape[0] for h in histories)
    stacked = mx.stack([padded_to(h.tokens, capacity) for h in histories])
    lengths = mx.stack([h.length for h in histories])
    stacked, lengths, copied, matched = compiled_step(_appended_drafts, n=n)(stacked, lengths, tokens, counts)
    for row, history in enumerate(histories):
        history.tokens, history.length = stacked[row, : history.tokens.shape[0]], lengths[row]
    return copied, matched


def _appended_drafts(history: mx.array, length: mx.array, tokens: mx.array, counts: mx.array,
                     n: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    index = mx.minimum(length[:, None] + mx.arange(tokens.shape[1]), history.shape[1] - 1)
    history = mx.put_along_axis(history, index, tokens.astype(mx.int32), axis=1)
    length = length + counts.astype(mx.int32)
    return (history, length, *copied_block(history, length, n))
