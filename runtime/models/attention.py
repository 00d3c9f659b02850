"""Attention over a device cache, as one CUDA kernel where it can be.

A round's forwards attend a few queries (a block of 16) to a cache whose valid length
lives on the device. ``mx.fast.scaled_dot_product_attention`` does that under a mask, and
on CUDA it hands such a shape to cuDNN, which builds and inserts a CUDA graph of its own
per call: about 15% of a round's host time (README, "the engine's host time per round").
The kernel here takes the valid lengths themselves instead of a mask and costs the host
one kernel launch: one thread block per (row, head, query), a warp per key stripe, an
online softmax in float32, the output written ``[B, L, heads, D]`` so that joining the
heads back into rows is a reshape rather than a copy.

What it computes (``cache_attention``): query ``i`` of batch row ``b`` attends the cache
keys ``j < lengths[b] + i + 1`` when ``causal`` (a verify: the block's own rows were
written at ``lengths[b]``), else ``j < lengths[b]``, and then, when ``fresh`` keys and
values are given (the drafter's block), every fresh key ``j < fresh_lengths[b]``. A verify
of several blocks (``branch``, runtime/branches.py) attends, for query ``i``, the keys before
``lengths[b]`` and its own block's up to itself, summed as a verify of that block alone. Where
``uses_kernel`` says no (the CPU, a prefill, head sizes the kernel does not take, or
``DFLASH_ATTENTION=sdpa`` to measure one against the other) the models run the same
attention as masked ``scaled_dot_product_attention``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import mlx.core as mx

WARPS = 4  # warps per thread block: each takes every WARPS-th key
MAX_QUERIES = 64  # more queries (a prefill) go to scaled_dot_product_attention

_HEADER = """
#define NEGATIVE_INFINITY (-__int_as_float(0x7f800000))

// keys [0, count) of a run whose first sits at position ``first``: a warp takes the positions
// equal to it modulo WARPS, so keys split a run or not are summed by the same warp in the same order
template <typename T, int E, int WARPS>
__device__ inline void attend_keys(const float* qv, const T* keys, const T* values, long key_stride,
                                   long key_dim_stride, long value_stride, long value_dim_stride, int count,
                                   int first, int warp, int lane, float& best, float& total, float* acc) {
  for (int j = ((warp - first) % WARPS + WARPS) % WARPS; j < count; j += WARPS) {
    const T* key = keys + j * key_stride;
    float dot = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) dot += qv[e] * static_cast<float>(key[(lane * E + e) * key_dim_stride]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, offset);
    const float top = fmaxf(best, dot);
    const float rescale = __expf(best - top);
    const float weight = __expf(dot - top);
    total = total * rescale + weight;
    const T* value = values + j * value_stride;
#pragma unroll
    for (int e = 0; e < E; ++e)
      acc[e] = acc[e] * rescale + weight * static_cast<float>(value[(lane * E + e) * value_dim_stride]);
    best = top;
  }
}
"""

_SOURCE = """
constexpr int E = D / 32;
const int queries = q_shape[2];
const int heads = q_shape[1];
const int block = blockIdx.x;
const int i = block % queries;
const int h = (block / queries) % heads;
const int b = block / (queries * heads);
const int warp = threadIdx.x / 32;
const int lane = threadIdx.x % 32;
const int kv_head = h / GQA;

const T* query = q + b * q_strides[0] + h * q_strides[1] + i * q_strides[2];
const float scale = rsqrtf(static_cast<float>(D));
float qv[E];
#pragma unroll
for (int e = 0; e < E; ++e) qv[e] = static_cast<float>(query[(lane * E + e) * q_strides[3]]) * scale;

float best = NEGATIVE_INFINITY, total = 0.f, acc[E];
#pragma unroll
for (int e = 0; e < E; ++e) acc[e] = 0.f;
const int start = lengths[ROW_LENGTHS ? b : 0];
const int valid = start + (CAUSAL ? i + 1 : 0);
const T* keys = k + b * k_strides[0] + kv_head * k_strides[1];
const T* values = v + b * v_strides[0] + kv_head * v_strides[1];
if (BRANCH > 0) {
  // blocks of BRANCH queries, each continuing the cache on its own: the keys before the
  // step, then the query's own block up to itself, at the positions a lone block's would have
  const int own = start + (i / BRANCH) * BRANCH;
  attend_keys<T, E, WARPS>(qv, keys, values, k_strides[2], k_strides[3], v_strides[2], v_strides[3],
                           min(start, k_shape[2]), 0, warp, lane, best, total, acc);
  attend_keys<T, E, WARPS>(qv, keys + own * k_strides[2], values + own * v_strides[2], k_strides[2], k_strides[3],
                           v_strides[2], v_strides[3], min(valid, k_shape[2]) - own, start, warp, lane, best, total, acc);
} else {
  attend_keys<T, E, WARPS>(qv, keys, values, k_strides[2], k_strides[3], v_strides[2], v_strides[3],
                           min(valid, k_shape[2]), 0, warp, lane, best, total, acc);
}
{fresh}
__shared__ float bests[WARPS], totals[WARPS], sums[WARPS][D];
if (lane == 0) { bests[warp] = best; totals[warp] = total; }
#pragma unroll
for (int e = 0; e < E; ++e) sums[warp][lane * E + e] = acc[e];
__syncthreads();
if (warp == 0) {
  float top = NEGATIVE_INFINITY;
  for (int w = 0; w < WARPS; ++w) top = fmaxf(top, bests[w]);
  float factor[WARPS], denominator = 0.f;
  for (int w = 0; w < WARPS; ++w) {
    factor[w] = totals[w] > 0.f ? __expf(bests[w] - top) : 0.f;
    denominator += totals[w] * factor[w];
  }
  T* row = out + ((static_cast<long>(b) * queries + i) * heads + h) * D;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    float o = 0.f;
    for (int w = 0; w < WARPS; ++w) o += sums[w][lane * E + e] * factor[w];
    row[lane * E + e] = static_cast<T>(denominator > 0.f ? o / denominator : 0.f);
  }
}
"""

# the drafter's block: its own keys and values, never written to the cache (MLX adds a kernel
# parameter for every ``name_shape`` or ``name_strides`` a source mentions, so the verify's
# kernel must not mention these)
_FRESH = """
attend_keys<T, E, WARPS>(qv, fk + b * fk_strides[0] + kv_head * fk_strides[1],
                         fv + b * fv_strides[0] + kv_head * fv_strides[1], fk_strides[2], fk_strides[3],
                         fv_strides[2], fv_strides[3], min(fresh_lengths[ROW_FRESH ? b : 0], fk_shape[2]),
                         0, warp, lane, best, total, acc);
"""


def kernel_enabled() -> bool:
    return os.environ.get("DFLASH_ATTENTION", "kernel") != "sdpa"


@lru_cache(maxsize=None)
def _kernel(fresh: bool) -> Any:
    inputs = ["q", "k", "v", "lengths"] + (["fk", "fv", "fresh_lengths"] if fresh else [])
    source = _SOURCE.replace("{fresh}", _FRESH if fresh else "")
    return mx.fast.cuda_kernel(name="dflash_cache_attention" + ("_fresh" if fresh else ""), input_names=inputs,
                               output_names=["out"], source=source, header=_HEADER, ensure_row_contiguous=False)


def uses_kernel(queries: int, head_dim: int, dtype: mx.Dtype, scale: float, branch: int = 0) -> bool:
    """Whether ``cache_attention`` takes these queries ``[B, H, queries, head_dim]``: on a GPU, a
    round's few queries, or its blocks of ``branch`` (a prefill's many go to cuDNN's flash
    attention), whole warps per head."""
    return (kernel_enabled() and mx.default_device() == mx.gpu and hasattr(mx.fast, "cuda_kernel")
            and (queries <= MAX_QUERIES or branch > 0) and head_dim % 32 == 0 and head_dim <= 256
            and abs(scale - head_dim**-0.5) < 1e-6 and dtype in (mx.float16, mx.bfloat16, mx.float32))


def cache_attention(q: mx.array, keys: mx.array, values: mx.array, lengths: mx.array, *, causal: bool,
                    scale: float, fresh: tuple[mx.array, mx.array, mx.array] | None = None, branch: int = 0) -> mx.array:
    """Attention of ``q [B, H, L, D]`` over cache rows ``keys/values [B, H_kv, T, D]`` (valid
    up to ``lengths``: int32, ``[B]`` or one for all rows) and ``fresh = (keys, values, lengths)``;
    returns ``[B, L, H, D]``. ``branch`` > 0 (causal): the queries are blocks of that many,
    each continuing the cache on its own (runtime.cache.causal_mask)."""
    b, heads, queries, head_dim = q.shape
    assert uses_kernel(queries, head_dim, q.dtype, scale, branch), "cache_attention: shapes uses_kernel refuses"
    assert causal or not branch, "blocks of queries attend causally"
    int32 = lambda x: x.astype(mx.int32)  # noqa: E731 (no op when it is already)
    inputs = [q, keys, values, int32(lengths)] + ([fresh[0], fresh[1], int32(fresh[2])] if fresh is not None else [])
    # a length array of one element stands for every row
    template = [("T", q.dtype), ("D", head_dim), ("GQA", heads // keys.shape[1]), ("CAUSAL", causal),
                ("ROW_LENGTHS", lengths.size > 1), ("WARPS", WARPS), ("BRANCH", branch if branch < queries else 0)]
    if fresh is not None:
        template.append(("ROW_FRESH", fresh[2].size > 1))
    (out,) = _kernel(fresh is not None)(
        inputs=inputs, template=template, grid=(b * heads * queries * 32 * WARPS, 1, 1),
        threadgroup=(32 * WARPS, 1, 1), output_shapes=[(b, queries, heads, head_dim)], output_dtypes=[q.dtype])
    return out
