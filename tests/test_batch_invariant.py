"""Batch-invariant projections (runtime.models.batch_invariant): a row's bits never depend on its batch,
so the engine's output equals plain greedy decoding on a GPU in half precision.

The kernel runs on a GPU only (CI has none: `python -m pytest tests/test_batch_invariant.py` on
the GPU machine runs those tests); on the CPU the models keep MLX's matmuls, which the last
test checks, and the engine's outputs equal plain greedy there in float32 (tests/test_engine.py).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import mlx.core as mx
import pytest
from mlx import nn

from protocol import GenerationParams
from runtime.bench import DEFAULT_PROMPTS, oracle_drafter, read_prompts, run_plain, run_together
from runtime.defaults import default_drafter_path, default_model_path
from runtime.loading import load_checkpoint, load_drafter, load_target
from runtime.models.batch_invariant import (
    MAX_ROWS,
    TENSOR_CORE_MIN_INNER,
    BatchInvariantLinear,
    BatchInvariantQuantizedLinear,
    applies,
    batch_invariant_matmul,
    batch_invariant_quantized_matmul,
    wants_tensor_cores,
)
from runtime.models.decoder import TransposedLinear
from runtime.models.tensor_core import TensorCoreLinear
from runtime.random_targets import random_checkpoint

on_gpu = pytest.mark.skipif(not applies(mx.zeros((8, 8), dtype=mx.bfloat16)), reason="the kernel runs on a GPU")


def random(shape: tuple[int, ...], dtype: mx.Dtype, seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


@on_gpu
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("outputs,inner", [(576, 576), (49152, 576), (576, 1536), (37, 24)])
def test_kernel_matches_a_float32_product(dtype: mx.Dtype, outputs: int, inner: int) -> None:
    x, w = random((19, inner), dtype, 1), random((outputs, inner), dtype, 2) * 0.05
    want = x.astype(mx.float32) @ w.astype(mx.float32).T
    got = batch_invariant_matmul(x, w).astype(mx.float32)
    # one rounding to the 16-bit type: half an ulp of the largest output
    assert float(mx.abs(got - want).max()) <= float(mx.abs(want).max()) * (2**-8 if dtype == mx.bfloat16 else 2**-11)


@on_gpu
@pytest.mark.parametrize("rows", [2, 7, 16, 40, MAX_ROWS])
def test_a_row_alone_has_the_bits_it_has_in_any_batch(rows: int) -> None:
    x, w = random((rows, 576), mx.bfloat16, 3), random((1000, 576), mx.bfloat16, 4) * 0.05
    together = batch_invariant_matmul(x, w)
    alone = mx.concatenate([batch_invariant_matmul(x[i : i + 1], w) for i in range(rows)])
    assert mx.array_equal(together, alone)
    # the batch's shape does not matter either: [B, L, in] as one block of rows
    assert mx.array_equal(batch_invariant_matmul(x.reshape(1, rows, 576), w)[0], alone)


@on_gpu
def test_kernel_inside_a_compiled_step_gives_the_eager_bits() -> None:
    x, w = random((16, 576), mx.bfloat16, 5), random((576, 576), mx.bfloat16, 6)
    layer = BatchInvariantLinear(w, random((576,), mx.bfloat16, 7))
    assert mx.array_equal(mx.compile(layer)(x), layer(x))


@on_gpu
def test_more_rows_than_the_limit_go_to_mlx_matmul() -> None:
    x, w = random((MAX_ROWS + 1, 64), mx.bfloat16, 8), random((32, 64), mx.bfloat16, 9)
    assert mx.array_equal(batch_invariant_matmul(x, w), x @ w.T)


@on_gpu
@pytest.mark.parametrize("group_size,bits", [(32, 4), (64, 4), (32, 8), (64, 2)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_quantized_kernel_matches_the_dequantized_float32_product(group_size: int, bits: int, dtype: mx.Dtype) -> None:
    w, scales, biases = mx.quantize(random((1000, 576), mx.float32, 10) * 0.05, group_size=group_size, bits=bits)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    x = random((19, 576), dtype, 11)
    want = x.astype(mx.float32) @ mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                                                group_size=group_size, bits=bits).T
    got = batch_invariant_quantized_matmul(x, w, scales, biases, group_size, bits).astype(mx.float32)
    assert float(mx.abs(got - want).max()) <= float(mx.abs(want).max()) * (2**-8 if dtype == mx.bfloat16 else 2**-11)
    alone = mx.concatenate([batch_invariant_quantized_matmul(x[i : i + 1], w, scales, biases, group_size, bits)
                            for i in range(19)])
    assert mx.array_equal(batch_invariant_quantized_matmul(x, w, scales, biases, group_size, bits), alone)


@on_gpu
# native: 4-bit as shipped, fp16; tc: the tensor-core kernel (runtime.models.tensor_core)
@pytest.mark.parametrize("dtype,setting", [("bfloat16", "1"), ("native", "all"), ("bfloat16", "tc"), ("native", "tc")])
def test_smollm2_engine_output_equals_plain_greedy(dtype: str, setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BATCH_INVARIANT", setting)
    target = load_target(default_model_path(), dtype=dtype)
    twin = TensorCoreLinear if setting == "tc" else (BatchInvariantLinear, BatchInvariantQuantizedLinear)
    assert isinstance(target.model.model.layers[0].mlp.down_proj, twin)
    drafter = load_drafter(default_drafter_path(), target)
    params = GenerationParams(max_tokens=128)
    prompts = [ids for _, ids in read_prompts(DEFAULT_PROMPTS, target)]
    want = [run_plain(target, ids, params).token_ids for ids in prompts]
    got = anyio.run(run_together, target, drafter, prompts, params, "pipelined").results
    assert [tokens for tokens, _ in got] == want
    alone = [anyio.run(run_together, target, drafter, [ids], params, "pipelined").results[0][0] for ids in prompts]
    assert alone == want


@on_gpu
@pytest.mark.parametrize("name", ["random:qwen3-8b-4bit", "random:qwen3-8b"])
def test_a_wide_target_verifies_on_tensor_cores_by_default_and_equals_plain_greedy(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_BATCH_INVARIANT", raising=False)
    shape = {"num_hidden_layers": 2, "hidden_size": TENSOR_CORE_MIN_INNER, "intermediate_size": 4096,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 4096}
    target = load_checkpoint(random_checkpoint(name, overrides=shape))
    assert isinstance(target.model.model.layers[0].mlp.down_proj, TensorCoreLinear)
    drafter = oracle_drafter(target, "random:1", 4.0, 16)
    params = GenerationParams(max_tokens=96)
    prompts = [[(7 * i + j) % 200 + 32 for j in range(12 + 3 * i)] for i in range(4)]
    want = [run_plain(target, ids, params).token_ids for ids in prompts]
    got = anyio.run(run_together, target, drafter, prompts, params, "pipelined").results
    assert [tokens for tokens, _ in got] == want


def test_on_the_cpu_the_models_keep_mlx_matmuls(tiny_llama_dir: Path) -> None:
    target = load_target(tiny_llama_dir, dtype="float16")
    layer = target.model.model.layers[0]
    if mx.default_device() == mx.gpu:
        pytest.skip("a GPU takes the kernel")
    assert not target.model.use_batch_invariant_projections()
    assert isinstance(layer.self_attn.qkv_proj, TransposedLinear) and "tied_head" not in target.model


@pytest.mark.parametrize("setting,wide,narrow", [
    ("1", True, False), ("tc", True, True), ("dense", False, False), ("all", False, False), ("0", False, False)])
def test_tensor_cores_take_the_projections_of_wide_targets_by_default(
        setting: str, wide: bool, narrow: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_BATCH_INVARIANT", setting)
    wide_dense = nn.Linear(TENSOR_CORE_MIN_INNER, 64, bias=False)
    narrow_dense = nn.Linear(576, 64, bias=False)
    assert wants_tensor_cores(nn.QuantizedLinear(TENSOR_CORE_MIN_INNER, 64, bias=False, group_size=64, bits=4), None) is wide
    assert wants_tensor_cores(nn.QuantizedEmbedding(64, TENSOR_CORE_MIN_INNER, group_size=64, bits=8), None) is wide
    assert wants_tensor_cores(wide_dense, wide_dense.weight) is wide
    assert wants_tensor_cores(nn.QuantizedLinear(576, 64, bias=False, group_size=64, bits=4), None) is narrow
    assert wants_tensor_cores(narrow_dense, narrow_dense.weight) is narrow
