"""Dense projections whose every row comes out the same, whatever else is in the batch.

Speculative output equals plain greedy decoding only if a block verify computes each row
exactly as a one-token step would. MLX multiplies one row (a decode step) with a
matrix-vector kernel and several rows (a verify's 16) with cuBLAS: in half precision the
two round some outputs one ulp apart, and in a small model one ulp flips a near-tie of the
top logits within tens of tokens (docs/exactness.md: 13 of 48 bf16 outputs equal plain
greedy on the H200). The kernel here fixes the order of every output's reduction: lane
``l`` of a warp sums the products at ``k = 8*l + 256*j + e`` in order with one fused
multiply-add each, in float32, and the warp adds its 32 partial sums in one fixed butterfly.
Which rows share a launch changes nothing in that order, so a row alone, in a block of 16
or in a batch of requests gets the same bits.

Each warp computes ``OUTS`` outputs for ``ROWS`` rows at a time, so a weight row is read
once per ``ROWS`` rows, and a whole decode step's weights once, as a matrix-vector kernel
does. On the CPU (MLX's kernels are row-invariant there in float32) the models keep MLX's
matmuls. MLX's affine 2/4/8-bit weights are dequantized in float32 inside the same loop, when
``DFLASH_BATCH_INVARIANT=all`` asks for it (not yet measured on a whole model). The tensor-core
kernel (``tensor_core.py``), which reads the weights once for up to 32 rows, takes the projections
of 4B-8B targets by default (4/8-bit and 16-bit alike), every projection it can under ``=tc`` and
none under ``=dense``; ``=0`` turns the kernels off, to measure one against another.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

import mlx.core as mx
from mlx import nn

from .tensor_core import tensor_core_twin, weight_inputs

WARPS = 4  # warps per thread block
OUTS = 4  # outputs per warp: a lane loads one vector of x per step for OUTS weight rows
ROWS = 8  # rows per warp pass: a lane keeps ROWS * OUTS sums
VECTOR = 8  # elements a lane loads at once (16 bytes of a 16-bit type)
# More rows go to MLX's matmul: a prefill (every decoder of a prompt prefills it alike) and
# verifies batched over more than 4 requests of 16 rows, where the kernel, which reads every
# row's input once per warp, costs more than MLX's (docs/exactness.md, "What the kernel costs")
MAX_ROWS = 64

_HEADER = """
template <typename T>
__device__ inline void load_vector(const T* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[e] = static_cast<float>(v[e]);
}
"""

_SOURCE = """
const int lane = threadIdx.x % 32;
const int warp = threadIdx.x / 32;
const int rows = x_shape[0];
const int outputs = w_shape[0];
const int n0 = (blockIdx.x * WARPS + warp) * OUTS;
const int m0 = blockIdx.y * ROWS;
float sums[ROWS][OUTS];
#pragma unroll
for (int r = 0; r < ROWS; ++r)
#pragma unroll
  for (int o = 0; o < OUTS; ++o) sums[r][o] = 0.f;
for (int k = lane * 8; k < K; k += 256) {
  float wv[OUTS][8];
#pragma unroll
  for (int o = 0; o < OUTS; ++o) {
    if (n0 + o < outputs) {
      {load_weights}
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) wv[o][e] = 0.f;
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (m0 + r < rows) {
      float xv[8];
      load_vector(x + static_cast<long>(m0 + r) * K + k, xv);
#pragma unroll
      for (int o = 0; o < OUTS; ++o)
#pragma unroll
        for (int e = 0; e < 8; ++e) sums[r][o] = fmaf(xv[e], wv[o][e], sums[r][o]);
    }
  }
}
#pragma unroll
for (int r = 0; r < ROWS; ++r)
#pragma unroll
  for (int o = 0; o < OUTS; ++o) {
    float s = sums[r][o];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffff, s, offset);
    if (lane == 0 && m0 + r < rows && n0 + o < outputs) out[static_cast<long>(m0 + r) * outputs + n0 + o] = static_cast<T>(s);
  }
"""


_DENSE = "load_vector(w + static_cast<long>(n0 + o) * K + k, wv[o]);"
# MLX's affine layout: 32/BITS weights a uint32 (the first in the low bits), a scale and a
# bias per GROUP weights; dequantized in float32, one fused multiply-add each
_QUANTIZED = """
      const long row = n0 + o;
      const uint32_t* words = w + row * (K * BITS / 32);
      const float scale = static_cast<float>(scales[row * (K / GROUP) + k / GROUP]);
      const float bias = static_cast<float>(biases[row * (K / GROUP) + k / GROUP]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int bit = (k + e) * BITS;
        const uint32_t q = (words[bit / 32] >> (bit % 32)) & ((1u << BITS) - 1u);
        wv[o][e] = fmaf(scale, static_cast<float>(q), bias);
      }
"""
BITS = (2, 4, 8)  # whole weights per uint32 word


def kernel_enabled() -> bool:
    return os.environ.get("DFLASH_BATCH_INVARIANT", "1") != "0"


# Projections this wide take the tensor-core kernel by default. At 4B-8B (inner 2,560-14,336) it
# made 4-bit pipelined rounds 1.4-1.8x faster (BENCHMARKS.md, session 24) and bf16 ones 1.7-2.3x
# faster than the dense kernel, which reads the weights once per 8 rows, with plain decoding 7-9%
# faster too (session 34), every output equal to plain greedy. At SmolLM2's widths (576-1,536) it
# left pipelined tok/s as it was and slowed plain decoding 10-18% (session 34): those stay off it.
TENSOR_CORE_MIN_INNER = 2048


def wants_tensor_cores(layer: nn.Module, dense_weight: mx.array | None) -> bool:
    """``DFLASH_BATCH_INVARIANT=tc``: every projection the tensor-core kernel takes; by default
    (``1``) those of at least ``TENSOR_CORE_MIN_INNER`` inputs, dense or quantized; ``dense``: none
    (the dense kernel only, quantized weights on MLX's matmuls)."""
    setting = os.environ.get("DFLASH_BATCH_INVARIANT", "1")
    if setting != "1":
        return setting == "tc"
    if dense_weight is not None:
        return dense_weight.shape[1] >= TENSOR_CORE_MIN_INNER
    quantized = isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    return quantized and weight_inputs(layer.weight, layer.bits) >= TENSOR_CORE_MIN_INNER


def quantized_enabled() -> bool:
    """Quantized weights take the kernel only when asked (``DFLASH_BATCH_INVARIANT=all``): its
    quantized form passed its own tests on the H200 for 4-bit, but no whole model has been
    measured with it yet (docs/exactness.md)."""
    return os.environ.get("DFLASH_BATCH_INVARIANT") == "all"


def on_gpu() -> bool:
    return kernel_enabled() and mx.default_device() == mx.gpu and hasattr(mx.fast, "cuda_kernel")


def applies(weight: mx.array) -> bool:
    """Whether a dense weight ``[out, in]`` can use the kernel (a GPU, 16-bit, whole vectors per lane)."""
    return on_gpu() and weight.ndim == 2 and weight.dtype in (mx.bfloat16, mx.float16) and weight.shape[1] % VECTOR == 0


@lru_cache(maxsize=None)
def _kernel(quantized: bool) -> Any:
    inputs = ["x", "w", "scales", "biases"] if quantized else ["x", "w"]
    return mx.fast.cuda_kernel(name="dflash_batch_invariant_" + ("qmm" if quantized else "matmul"), input_names=inputs,
                               output_names=["out"], source=_SOURCE.replace("{load_weights}", _QUANTIZED if quantized else _DENSE),
                               header=_HEADER, ensure_row_contiguous=True)


def _launch(x: mx.array, weights: list[mx.array], n: int, k: int, rows_per_pass: int,
            extra: list[tuple[str, Any]]) -> mx.array:
    rows = x.size // k
    warps = -(-n // OUTS)
    (out,) = _kernel(len(weights) > 1)(
        inputs=[x.reshape(rows, k), *weights],
        template=[("T", x.dtype), ("K", k), ("WARPS", WARPS), ("OUTS", OUTS), ("ROWS", rows_per_pass), *extra],
        grid=(-(-warps // WARPS) * 32 * WARPS, -(-rows // rows_per_pass), 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(rows, n)], output_dtypes=[x.dtype])
    return out.reshape(*x.shape[:-1], n)


def batch_invariant_matmul(x: mx.array, weight: mx.array, rows_per_pass: int = ROWS) -> mx.array:
    """``x @ weight.T`` for ``x [..., in]`` and ``weight [out, in]``, each row reduced in a fixed order.

    ``rows_per_pass``: rows a warp computes per read of its weight rows (registers against
    weight reads; any value gives the same bits).
    """
    n, k = weight.shape
    if x.size // k > MAX_ROWS or x.dtype != weight.dtype:
        return x @ weight.T
    return _launch(x, [weight], n, k, rows_per_pass, [])


def batch_invariant_quantized_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
                                     group_size: int, bits: int, rows_per_pass: int = ROWS) -> mx.array:
    """``x @ W.T`` for W in MLX's affine layout (``weight [out, in*bits/32]`` uint32, ``scales`` and
    ``biases [out, in/group_size]``), each row reduced in a fixed order, as the dense kernel."""
    n, k = weight.shape[0], weight_inputs(weight, bits)
    if x.size // k > MAX_ROWS or x.dtype != scales.dtype:
        return mx.quantized_matmul(x, weight, scales, biases, transpose=True, group_size=group_size, bits=bits)
    return _launch(x, [weight, scales, biases], n, k, rows_per_pass, [("GROUP", group_size), ("BITS", bits)])


def quantized_applies(layer: nn.Module) -> bool:
    """Whether a quantized linear or embedding can use the kernel: MLX's affine 2/4/8-bit, 16-bit scales."""
    return (quantized_enabled() and on_gpu() and isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
            and layer.bits in BITS
            and getattr(layer, "mode", "affine") == "affine" and "biases" in layer and layer.group_size % VECTOR == 0
            and layer.scales.dtype in (mx.bfloat16, mx.float16))


class BatchInvariantLinear(nn.Module):
    """A dense projection (``weight [out, in]``, optional bias) computed by :func:`batch_invariant_matmul`."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None) -> None:
        super().__init__()
        self.weight = mx.contiguous(weight)
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        out = batch_invariant_matmul(x, self.weight)
        return out + self.bias if "bias" in self else out


class BatchInvariantQuantizedLinear(nn.Module):
    """An affine-quantized projection (a ``QuantizedLinear`` or a tied ``QuantizedEmbedding``'s head)
    computed by :func:`batch_invariant_quantized_matmul`."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.group_size, self.bits = layer.group_size, layer.bits
        self.weight, self.scales, self.biases = layer.weight, layer.scales, layer.biases
        if isinstance(layer, nn.QuantizedLinear) and "bias" in layer:
            self.bias = layer.bias

    def __call__(self, x: mx.array) -> mx.array:
        out = batch_invariant_quantized_matmul(x, self.weight, self.scales, self.biases, self.group_size,
                                               self.bits)
        return out + self.bias if "bias" in self else out


def batch_invariant(layer: nn.Module, dense_weight: mx.array | None) -> nn.Module | None:
    """The batch-invariant twin of a projection (``dense_weight``: its weight as ``[out, in]`` when
    dense), or None where the kernel does not apply."""
    if on_gpu() and wants_tensor_cores(layer, dense_weight) and (twin := tensor_core_twin(layer, dense_weight)) is not None:
        return twin
    if dense_weight is not None and applies(dense_weight):
        return BatchInvariantLinear(dense_weight, layer.bias if "bias" in layer else None)
    if quantized_applies(layer):
        return BatchInvariantQuantizedLinear(layer)
    return None
