"""Projections on tensor cores that read each weight once for up to 32 rows and give a row the
same bits whatever else is in the batch.

A verify of 16 rows at 4B-8B is bound by reading the weights, so it should cost about what a
one-token step costs. MLX's 4-bit matmul over 16 rows costs 2-4x its one-row kernel at
Qwen3-8B's shapes, and its one-row kernel reads 0.5-0.9 TB/s (BENCHMARKS.md, session 21); the
batch-invariant FMA kernel (``batch_invariant.py``) reads every row's input again per warp, so
at 16 rows it costs more still. Here each warp dequantizes a 16-output tile of the weights
into registers once per 64-weight chunk and multiplies it with up to 32 rows on the tensor
cores (``mma.sync.m16n8k16``: the weights are the 16-row A operand, the input rows the
8-column B operand, so one row costs the same one instruction as eight).

Invariance: an output's sum runs over its chunks in a fixed order: each warp of a block takes
every ``SPLIT``-th group of ``UNROLL`` chunks in ascending order, and the block adds the
``SPLIT`` warps' sums in warp order. ``SPLIT`` and ``UNROLL`` depend only on the weight's shape
(:func:`plan`), never on the rows; the other settings (output tiles per warp, warps per
block, row tiles) only decide who computes an output, not in what order. A tensor-core
instruction computes each output from its own row and column alone, so a row's bits do not
depend on the other rows of its tile (tested on the GPU: tests/test_tensor_core.py).

Weights: MLX's affine 4/8-bit layout as mlx-community ships it (``weight [out, in*bits/32]``
uint32, the first weight in the low bits; ``scales``/``biases [out, in/group]`` in the
activation type), dequantized in float32 (one fused multiply-add) and rounded to the 16-bit
activation type, or dense bf16/fp16 weights (``bits`` 16). Within a chunk a lane holds 16
consecutive weights of a row, which the instruction's fragment layout (logical k pairs
``2t, 2t+1`` and ``2t+8, 2t+9``) does not match; the k axis is permuted instead, for the weights
and the inputs alike, which leaves the sum's terms unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
from mlx import nn

CHUNK = 64  # weights along k a warp takes per step: one quantization group of 64, four mma steps
ROW_TILE = 8  # input rows per mma (its N)
MAX_ROW_TILES = 4  # row tiles a block keeps: more rows run as more blocks along y
BITS = (4, 8, 16)  # 16: dense 16-bit weights
MAX_ROWS = 64  # more rows (a long prefill) go to MLX's matmul, which reads the weights fewer times

_HEADER = r"""
__device__ inline uint32_t pack_pair(float lo, float hi, __half) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ inline uint32_t pack_pair(float lo, float hi, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ inline void mma_16816(float* c, const uint32_t* a, const uint32_t* b, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline void mma_16816(float* c, const uint32_t* a, const uint32_t* b, __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// A lane's 16 consecutive weights of one row in a chunk: BITS/2 words, read once, not kept in L1
template <int WORDS>
__device__ inline void load_words(const uint32_t* p, uint32_t* out) {
  if constexpr (WORDS == 2) {
    const uint2 v = __ldcs(reinterpret_cast<const uint2*>(p));
    out[0] = v.x; out[1] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < WORDS; i += 4) {
      const uint4 v = __ldcs(reinterpret_cast<const uint4*>(p + i));
      out[i] = v.x; out[i + 1] = v.y; out[i + 2] = v.z; out[i + 3] = v.w;
    }
  }
}
"""

# Template parameters: T (activations), K, BITS (16: dense), GROUP, TILES (16-output tiles a
# warp computes), WARPS_N (warps of a block side by side along the outputs), SPLIT (warps of a
# block along k), UNROLL (chunks a warp loads before it multiplies), ROW_TILES (8-row tiles).
_SOURCE = r"""
constexpr int WORDS = BITS / 2;
constexpr int CHUNKS = K / 64;
const int lane = threadIdx.x & 31;
const int warp = threadIdx.x >> 5;
const int g = lane >> 2;
const int t = lane & 3;
const int wn = warp % WARPS_N;
const int ks = warp / WARPS_N;
const int rows = x_shape[0];
const int outputs = w_shape[0];
const int n_base = (blockIdx.x * WARPS_N + wn) * (16 * TILES);
const int row_base = blockIdx.y * (8 * ROW_TILES);
float acc[TILES][ROW_TILES][4];
#pragma unroll
for (int m = 0; m < TILES; ++m)
#pragma unroll
  for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[m][r][i] = 0.f;

for (int group = ks; group * UNROLL < CHUNKS; group += SPLIT) {
  uint32_t wq[UNROLL][TILES][2][WORDS];
  float scale[UNROLL][TILES][2], bias[UNROLL][TILES][2];
  uint32_t xb[UNROLL][ROW_TILES][8];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int chunk = group * UNROLL + u;
    const int k = chunk * 64 + 16 * t;  // this lane's 16 weights (and inputs) of the chunk
#pragma unroll
    for (int m = 0; m < TILES; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = n_base + 16 * m + g + 8 * h;
        if (chunk < CHUNKS && n < outputs) {
          load_words<WORDS>(w + static_cast<long>(n) * (K * BITS / 32) + k * BITS / 32, wq[u][m][h]);
          if constexpr (BITS != 16) {
            scale[u][m][h] = static_cast<float>(scales[static_cast<long>(n) * (K / GROUP) + k / GROUP]);
            bias[u][m][h] = static_cast<float>(biases[static_cast<long>(n) * (K / GROUP) + k / GROUP]);
          }
        } else {
#pragma unroll
          for (int i = 0; i < WORDS; ++i) wq[u][m][h][i] = 0u;
          scale[u][m][h] = 0.f;
          bias[u][m][h] = 0.f;
        }
      }
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r) {
      const int row = row_base + 8 * r + g;
      if (chunk < CHUNKS && row < rows) {
        const uint4* p = reinterpret_cast<const uint4*>(x + static_cast<long>(row) * K + k);
        const uint4 lo = p[0], hi = p[1];
        xb[u][r][0] = lo.x; xb[u][r][1] = lo.y; xb[u][r][2] = lo.z; xb[u][r][3] = lo.w;
        xb[u][r][4] = hi.x; xb[u][r][5] = hi.y; xb[u][r][6] = hi.z; xb[u][r][7] = hi.w;
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) xb[u][r][i] = 0u;
      }
    }
  }
#pragma unroll
  for (int u = 0; u < UNROLL; ++u)
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      // step s takes the lane's weights 4s..4s+3 as logical k (2t, 2t+1, 2t+8, 2t+9)
      uint32_t a[TILES][4];
#pragma unroll
      for (int m = 0; m < TILES; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int j = 4 * s + 2 * half;  // the pair j, j + 1 of the lane's 16
            if constexpr (BITS == 16) {
              a[m][h + 2 * half] = wq[u][m][h][j / 2];
            } else {
              constexpr unsigned MASK = (1u << BITS) - 1u;
              const uint32_t word = wq[u][m][h][j * BITS / 32];
              const float q0 = static_cast<float>((word >> ((j * BITS) % 32)) & MASK);
              const float q1 = static_cast<float>((word >> (((j + 1) * BITS) % 32)) & MASK);
              a[m][h + 2 * half] = pack_pair(fmaf(scale[u][m][h], q0, bias[u][m][h]),
                                             fmaf(scale[u][m][h], q1, bias[u][m][h]), T{});
            }
          }
#pragma unroll
      for (int r = 0; r < ROW_TILES; ++r) {
        const uint32_t b[2] = {xb[u][r][2 * s], xb[u][r][2 * s + 1]};
#pragma unroll
        for (int m = 0; m < TILES; ++m) mma_16816(acc[m][r], a[m], b, T{});
      }
    }
}

if constexpr (SPLIT > 1) {
  // the block's k-split warps add their sums in warp order
  __shared__ float partial[(SPLIT > 1 ? SPLIT - 1 : 1) * WARPS_N * TILES * ROW_TILES * 4 * 32];
  if (ks > 0) {
#pragma unroll
    for (int m = 0; m < TILES; ++m)
#pragma unroll
      for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          partial[((((ks - 1) * WARPS_N + wn) * TILES + m) * ROW_TILES * 4 + r * 4 + i) * 32 + lane] = acc[m][r][i];
  }
  __syncthreads();
  if (ks == 0) {
    for (int other = 1; other < SPLIT; ++other)
#pragma unroll
      for (int m = 0; m < TILES; ++m)
#pragma unroll
        for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
          for (int i = 0; i < 4; ++i)
            acc[m][r][i] += partial[((((other - 1) * WARPS_N + wn) * TILES + m) * ROW_TILES * 4 + r * 4 + i) * 32 + lane];
  }
}
if (ks == 0) {
#pragma unroll
  for (int m = 0; m < TILES; ++m)
#pragma unroll
    for (int r = 0; r < ROW_TILES; ++r)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row_base + 8 * r + 2 * t + (i & 1);
        const int n = n_base + 16 * m + g + 8 * (i >> 1);
        if (row < rows && n < outputs) out[static_cast<long>(row) * outputs + n] = static_cast<T>(acc[m][r][i]);
      }
}
"""


@dataclass(frozen=True)
class Plan:
    """How a launch divides the work. ``split`` and ``unroll`` fix every output's order of
    summation, so they come from the weight's shape alone; ``tiles``, ``warps_n`` and
    ``row_tiles`` (8-row tiles a block keeps; 0: as many as the rows need, at most
    ``MAX_ROW_TILES``) only share the outputs out and may follow the rows."""

    split: int
    unroll: int
    tiles: int
    warps_n: int
    row_tiles: int = 0


def plan(inner: int, bits: int) -> Plan:
    """Enough warps to keep every SM reading, for a weight of ``inner`` inputs at ``bits``.

    k is split across up to 8 warps of a block while each still takes two groups of chunks:
    many short sums in flight beat few long ones at every Qwen3-8B shape, one row or 16, the LM
    head's included (the plan sweep, BENCHMARKS.md session 24). Neither the rows nor anything
    else a call may vary goes in, so the order of summation is the weight's alone."""
    chunks = inner // CHUNK
    unroll = 2 if bits != 16 else 1
    split = 1
    while split < 8 and chunks // (unroll * split * 2) >= 2:
        split *= 2
    return Plan(split=split, unroll=unroll, tiles=1, warps_n=max(1, min(4, 8 // split)))


def weight_inputs(weight: mx.array, bits: int) -> int:
    """A projection's inputs from its weight: ``[out, in]`` when dense (``bits`` 16), or MLX's
    packed ``[out, in * bits / 32]`` words."""
    return weight.shape[1] if bits == 16 else weight.shape[1] * 32 // bits


def applies(outputs: int, inner: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
    """Whether the kernel can take a weight of this shape and format (a GPU, 16-bit activations,
    whole chunks and 16-output tiles)."""
    return (mx.default_device() == mx.gpu and hasattr(mx.fast, "cuda_kernel") and bits in BITS
            and dtype in (mx.bfloat16, mx.float16) and inner % CHUNK == 0 and outputs % 16 == 0
            and (bits == 16 or group_size in (32, 64, 128)))


# Dense weights travel as uint32 words (two 16-bit weights each), as packed ones do, and have
# no scales or biases for the source's quantized branch to name
_DENSE = "const T* scales = nullptr;\nconst T* biases = nullptr;\n"


@lru_cache(maxsize=None)
def _kernel(quantized: bool) -> Any:
    inputs = ["x", "w", "scales", "biases"] if quantized else ["x", "w"]
    return mx.fast.cuda_kernel(name="dflash_tensor_core_" + ("qmm" if quantized else "matmul"), input_names=inputs,
                               output_names=["out"], source=_SOURCE if quantized else _DENSE + _SOURCE,
                               header=_HEADER, ensure_row_contiguous=True)


def tensor_core_matmul(x: mx.array, weight: mx.array, scales: mx.array | None = None, biases: mx.array | None = None,
                       group_size: int = 64, bits: int = 16, how: Plan | None = None) -> mx.array:
    """``x @ W.T`` for ``x [..., in]`` and W ``[out, in]``: dense 16-bit (``bits`` 16) or MLX's
    affine ``bits``-bit layout with its ``scales`` and ``biases``. ``how`` overrides :func:`plan`
    (to measure one plan against another)."""
    n = weight.shape[0]
    k = weight_inputs(weight, bits)
    rows = x.size // k
    p = how or plan(k, bits)
    row_tiles = p.row_tiles or min(MAX_ROW_TILES, -(-rows // ROW_TILE))
    warps = p.warps_n * p.split
    quantized = bits != 16
    weights = [weight, scales, biases] if quantized else [weight.view(mx.uint32)]
    (out,) = _kernel(quantized)(
        inputs=[x.reshape(rows, k), *weights],
        template=[("T", x.dtype), ("K", k), ("BITS", bits), ("GROUP", group_size if quantized else 64),
                  ("TILES", p.tiles), ("WARPS_N", p.warps_n), ("SPLIT", p.split), ("UNROLL", p.unroll),
                  ("ROW_TILES", row_tiles)],
        grid=(-(-n // (16 * p.tiles * p.warps_n)) * 32 * warps, -(-rows // (ROW_TILE * row_tiles)), 1),
        threadgroup=(32 * warps, 1, 1), output_shapes=[(rows, n)], output_dtypes=[x.dtype])
    return out.reshape(*x.shape[:-1], n)


class TensorCoreLinear(nn.Module):
    """A projection computed by :func:`tensor_core_matmul` up to ``MAX_ROWS`` rows, by MLX's matmul
    past them (a long prefill, which every decoder of a prompt runs alike): a ``QuantizedLinear``
    (or a tied ``QuantizedEmbedding``'s head) in MLX's affine layout, or a dense ``weight [out, in]``."""

    def __init__(self, layer: nn.Module, dense_weight: mx.array | None = None) -> None:
        super().__init__()
        if dense_weight is not None:
            self.bits, self.group_size, self.weight = 16, 0, mx.contiguous(dense_weight)
        else:
            self.bits, self.group_size = layer.bits, layer.group_size
            self.weight, self.scales, self.biases = layer.weight, layer.scales, layer.biases
        if "bias" in layer and not isinstance(layer, nn.QuantizedEmbedding):
            self.bias = layer.bias

    def __call__(self, x: mx.array) -> mx.array:
        if x.size // x.shape[-1] > MAX_ROWS:
            out = (x @ self.weight.T if self.bits == 16 else
                   mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                       group_size=self.group_size, bits=self.bits))
        else:
            out = tensor_core_matmul(x, self.weight, self.scales if self.bits != 16 else None,
                                     self.biases if self.bits != 16 else None, self.group_size, self.bits)
        return out + self.bias if "bias" in self else out


def tensor_core_twin(layer: nn.Module, dense_weight: mx.array | None) -> TensorCoreLinear | None:
    """The tensor-core twin of a projection (``dense_weight``: its weight as ``[out, in]`` when
    dense), or None where the kernel does not take it."""
    if dense_weight is not None:
        n, k = dense_weight.shape
        return TensorCoreLinear(layer, dense_weight) if applies(n, k, 16, 0, dense_weight.dtype) else None
    if not isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)) or getattr(layer, "mode", "affine") != "affine":
        return None
    if "biases" not in layer:
        return None
    n, k = layer.weight.shape[0], weight_inputs(layer.weight, layer.bits)
    return TensorCoreLinear(layer) if applies(n, k, layer.bits, layer.group_size, layer.scales.dtype) else None
