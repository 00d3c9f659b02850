"""The tensor-core projection kernel (runtime.models.tensor_core): it computes ``x @ W.T`` to one
rounding, and a row's bits do not depend on the other rows of its launch or on how the
outputs are shared among warps.

The kernel runs on a GPU only (CI has none): `python -m pytest tests/test_tensor_core.py` on
the GPU machine runs these tests.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx import nn

from runtime.models.tensor_core import MAX_ROWS, Plan, applies, plan, tensor_core_matmul, tensor_core_twin

on_gpu = pytest.mark.skipif(not applies(64, 64, 4, 64, mx.bfloat16), reason="the kernel runs on a GPU")


def random(shape: tuple[int, ...], dtype: mx.Dtype, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


def weights(outputs: int, inner: int, bits: int, group_size: int, dtype: mx.Dtype) -> tuple[list[mx.array], mx.array]:
    """The kernel's weight arrays and the float32 matrix they stand for."""
    w = random((outputs, inner), mx.float32, 10) * 0.05
    if bits == 16:
        w = w.astype(dtype)
        return [w], w.astype(mx.float32)
    packed, scales, biases = mx.quantize(w, group_size=group_size, bits=bits)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    return [packed, scales, biases], mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32),
                                                   group_size=group_size, bits=bits)


def product(x: mx.array, arrays: list[mx.array], bits: int, group_size: int, how: Plan | None = None) -> mx.array:
    w, *quantization = arrays
    scales, biases = quantization or (None, None)
    return tensor_core_matmul(x, w, scales, biases, group_size=group_size, bits=bits, how=how)


@on_gpu
@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (8, 64), (4, 128), (16, 0)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("outputs,inner", [(960, 576), (576, 1536), (4096, 4096), (1024, 12288)])
def test_kernel_matches_a_float32_product(bits: int, group_size: int, dtype: mx.Dtype, outputs: int, inner: int) -> None:
    if bits != 16 and inner % group_size:
        pytest.skip("MLX quantizes whole groups only")
    arrays, w = weights(outputs, inner, bits, group_size, dtype)
    x = random((19, inner), dtype, 11)
    want = x.astype(mx.float32) @ w.T
    got = product(x, arrays, bits, group_size).astype(mx.float32)
    # the output's rounding, and the dequantized weights' rounding to the 16-bit type
    ulp = 2**-8 if dtype == mx.bfloat16 else 2**-11
    assert float(mx.abs(got - want).max()) <= float(mx.abs(want).max()) * ulp * (1 if bits == 16 else 4)


@on_gpu
@pytest.mark.parametrize("bits", [4, 8, 16])
@pytest.mark.parametrize("rows", [2, 7, 9, 16, 33, 64])
def test_a_row_alone_has_the_bits_it_has_in_any_batch(bits: int, rows: int) -> None:
    arrays, _ = weights(2048, 1536, bits, 64, mx.bfloat16)
    x = random((rows, 1536), mx.bfloat16, 3)
    together = product(x, arrays, bits, 64)
    alone = mx.concatenate([product(x[i : i + 1], arrays, bits, 64) for i in range(rows)])
    assert mx.array_equal(together, alone)
    assert mx.array_equal(product(x.reshape(1, rows, 1536), arrays, bits, 64)[0], alone)


@on_gpu
def test_how_outputs_are_shared_among_warps_changes_no_bit() -> None:
    arrays, _ = weights(4096, 4096, 4, 64, mx.float16)
    x = random((16, 4096), mx.float16, 4)
    base = plan(4096, 4)
    # tiles 4 with warps_n 4 asks for more than a block has (H100: "too many resources requested")
    outs = [product(x, arrays, 4, 64, Plan(base.split, base.unroll, tiles, warps_n))
            for tiles, warps_n in ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1))]
    assert all(mx.array_equal(out, outs[0]) for out in outs[1:])


@on_gpu
def test_a_quantized_linear_twin_takes_the_kernel_up_to_max_rows_and_mlx_past_them() -> None:
    layer = nn.QuantizedLinear(1536, 2048, bias=True, group_size=64, bits=4)
    layer.set_dtype(mx.bfloat16)
    twin = tensor_core_twin(layer, None)
    x = random((MAX_ROWS + 1, 1536), mx.bfloat16, 12)
    assert mx.array_equal(twin(x[:16]), tensor_core_matmul(x[:16], layer.weight, layer.scales, layer.biases, 64, 4) + layer.bias)
    assert mx.array_equal(twin(x), layer(x))


@on_gpu
def test_weights_the_kernel_cannot_take_get_no_twin() -> None:
    assert tensor_core_twin(nn.QuantizedLinear(1536, 2048, group_size=64, bits=2), None) is None  # 2-bit
    assert tensor_core_twin(nn.Linear(100, 24), mx.zeros((24, 100), dtype=mx.bfloat16)) is None  # inner not whole chunks
    assert tensor_core_twin(nn.Linear(64, 24), mx.zeros((24, 64), dtype=mx.float32)) is None  # float32 activations
