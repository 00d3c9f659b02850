"""The CUDA attention kernel (runtime.models.attention) against masked scaled_dot_product_attention.

It runs on a GPU only (CI has none: `python -m pytest tests/test_attention_kernel.py` on the
GPU machine runs them), for every layout a round uses: a verify's causal block over its cache
(one length, or one per stacked row), the drafter's block over its context and itself, queries
that are strided views, and the kernel inside a compiled step.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from runtime.models.attention import cache_attention, uses_kernel

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BUFFER = 9, 3, 64, 16, 512
SCALE = HEAD_DIM**-0.5

pytestmark = pytest.mark.skipif(not uses_kernel(BLOCK, HEAD_DIM, mx.float16, SCALE),
                                reason="the attention kernel runs on a GPU")

# float32: the kernel and the GPU's float32 sdpa differed by up to 1.3e-4 on the H200 (random inputs, 300 keys)
TOLERANCE = {mx.float32: 3e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}


def random(shape: tuple[int, ...], dtype: mx.Dtype, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def masked_reference(q: mx.array, keys: mx.array, values: mx.array, lengths: list[int], causal: bool,
                     fresh: tuple[mx.array, mx.array, list[int]] | None = None) -> mx.array:
    """The same attention, row by row, as sdpa in float32 under an explicit mask: ``[B, L, H, D]``."""
    rows = []
    for b, length in enumerate(lengths):
        limit = length + (mx.arange(q.shape[2])[:, None] + 1 if causal else 0)
        mask = mx.broadcast_to(mx.arange(keys.shape[2]) < limit, (q.shape[2], keys.shape[2]))
        k, v = keys[b : b + 1], values[b : b + 1]
        if fresh is not None:
            seen = mx.broadcast_to(mx.arange(fresh[0].shape[2]) < fresh[2][b], (q.shape[2], fresh[0].shape[2]))
            mask = mx.concatenate([mask, seen], axis=1)
            k, v = mx.concatenate([k, fresh[0][b : b + 1]], axis=2), mx.concatenate([v, fresh[1][b : b + 1]], axis=2)
        f32 = lambda x: x.astype(mx.float32)  # noqa: E731
        rows.append(mx.fast.scaled_dot_product_attention(f32(q[b : b + 1]), f32(k), f32(v), scale=SCALE, mask=mask))
    return mx.concatenate(rows).transpose(0, 2, 1, 3)


def assert_close(got: mx.array, want: mx.array, dtype: mx.Dtype) -> None:
    difference = mx.max(mx.abs(got.astype(mx.float32) - want)).item()
    assert difference < TOLERANCE[dtype], f"max abs difference {difference}"


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_verify_block_attends_its_cache_causally(dtype: mx.Dtype) -> None:
    q = random((1, HEADS, BLOCK, HEAD_DIM), dtype, 0)
    keys, values = random((1, KV_HEADS, BUFFER, HEAD_DIM), dtype, 1), random((1, KV_HEADS, BUFFER, HEAD_DIM), dtype, 2)
    got = cache_attention(q, keys, values, mx.array(300, dtype=mx.int32), causal=True, scale=SCALE)
    assert got.shape == (1, BLOCK, HEADS, HEAD_DIM)
    assert_close(got, masked_reference(q, keys, values, [300], causal=True), dtype)


def test_stacked_rows_attend_at_their_own_lengths() -> None:
    lengths = [0, 100, BUFFER - BLOCK]
    q = random((3, HEADS, BLOCK, HEAD_DIM), mx.float16, 3)
    keys, values = random((3, KV_HEADS, BUFFER, HEAD_DIM), mx.float16, 4), random((3, KV_HEADS, BUFFER, HEAD_DIM), mx.float16, 5)
    got = cache_attention(q, keys, values, mx.array(lengths, dtype=mx.int32), causal=True, scale=SCALE)
    assert_close(got, masked_reference(q, keys, values, lengths, causal=True), mx.float16)


def test_drafter_block_attends_its_context_and_its_own_rows() -> None:
    lengths, block_lens = [5, 200], [BLOCK, 9]
    q = random((2, HEADS, BLOCK, HEAD_DIM), mx.float16, 6)
    keys, values = random((2, KV_HEADS, BUFFER, HEAD_DIM), mx.float16, 7), random((2, KV_HEADS, BUFFER, HEAD_DIM), mx.float16, 8)
    fresh_k, fresh_v = random((2, KV_HEADS, BLOCK, HEAD_DIM), mx.float16, 9), random((2, KV_HEADS, BLOCK, HEAD_DIM), mx.float16, 10)
    got = cache_attention(q, keys, values, mx.array(lengths, dtype=mx.int32), causal=False, scale=SCALE,
                          fresh=(fresh_k, fresh_v, mx.array(block_lens, dtype=mx.int32)))
    want = masked_reference(q, keys, values, lengths, causal=False, fresh=(fresh_k, fresh_v, block_lens))
    assert_close(got, want, mx.float16)


def test_strided_queries_and_a_compiled_step_give_the_same_attention() -> None:
    """Queries split out of a transposed projection (as the verify's are), eager and compiled."""
    qkv = random((1, BLOCK, HEADS + 2 * KV_HEADS, HEAD_DIM), mx.float16, 11).transpose(0, 2, 1, 3)
    q, k_new, v_new = mx.split(qkv, [HEADS, HEADS + KV_HEADS], axis=1)
    keys, values = random((1, KV_HEADS, BUFFER, HEAD_DIM), mx.float16, 12), random((1, KV_HEADS, BUFFER, HEAD_DIM), mx.float16, 13)
    length = mx.array(77, dtype=mx.int32)

    def step(q: mx.array, keys: mx.array, values: mx.array, length: mx.array) -> mx.array:
        keys = mx.slice_update(keys, k_new, length.reshape(1), axes=(2,))
        values = mx.slice_update(values, v_new, length.reshape(1), axes=(2,))
        return cache_attention(q, keys, values, length, causal=True, scale=SCALE)

    written_k = mx.slice_update(keys, k_new, mx.array([77]), axes=(2,))
    written_v = mx.slice_update(values, v_new, mx.array([77]), axes=(2,))
    want = masked_reference(q, written_k, written_v, [77], causal=True)
    assert_close(step(q, keys, values, length), want, mx.float16)
    assert_close(mx.compile(step)(q, keys, values, length), want, mx.float16)


@pytest.mark.parametrize("width", [BLOCK, 6])
def test_blocks_verified_together_attend_as_each_block_alone_bit_for_bit(width: int) -> None:
    """Four blocks end to end (runtime/branches.py): each query sees the cache and its own block
    only, and sums its keys as the block's own causal verify does, at any length and block width."""
    blocks, lengths = 4, [0, 101, 300]
    q = random((3, HEADS, blocks * width, HEAD_DIM), mx.bfloat16, 14)
    keys, values = random((3, KV_HEADS, BUFFER, HEAD_DIM), mx.bfloat16, 15), random((3, KV_HEADS, BUFFER, HEAD_DIM), mx.bfloat16, 16)
    start = mx.array(lengths, dtype=mx.int32)
    got = cache_attention(q, keys, values, start, causal=True, scale=SCALE, branch=width)
    for b in range(blocks):
        def alone_at_start(buffer: mx.array) -> mx.array:  # block b's rows where a lone block's would be
            return mx.stack([mx.concatenate([row[:, :n], row[:, n + b * width : n + (b + 1) * width], row[:, n + width :]], axis=1)
                             for row, n in zip(buffer, lengths)])

        alone = cache_attention(q[:, :, b * width : (b + 1) * width], alone_at_start(keys), alone_at_start(values), start,
                                causal=True, scale=SCALE)
        assert mx.array_equal(got[:, b * width : (b + 1) * width], alone), f"block {b}"
