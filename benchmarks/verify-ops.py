"""What a verify forward's ops cost at 1 row and at a block's rows, at a published model's shapes.

    PYTHONPATH=. python benchmarks/verify-ops.py [--model qwen3-8b] [--rows 1 16] [--bits 4 0]

A verify of 16 rows should cost about one one-token forward where the weights' reads bound
it (4B-8B targets on a GPU), yet at 8B it costs 2-2.7 (BENCHMARKS.md, session 16). This
times each kind of op a decoder layer runs, alone, at the model's shapes: the projections
(``mx.quantized_matmul`` at ``--bits``, 0 for a dense bf16 matmul), attention over
``--context`` keys, the norms and the LM head, so the op that does not stay flat from one row
to many can be named. ``--impl kernel`` times the projections with the batch-invariant kernel
(runtime.models.batch_invariant) instead of MLX's matmuls, ``--impl tc`` with the tensor-core
kernel (runtime.models.tensor_core; ``--plans split,unroll,tiles,warps_n ...`` times each plan
given instead of the kernel's own). Figures: device microseconds per op, from a chain of
``CHAIN`` queued ops.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import mlx.core as mx

from runtime.models.batch_invariant import batch_invariant_matmul, batch_invariant_quantized_matmul
from runtime.models.tensor_core import Plan, tensor_core_matmul
from runtime.random_targets import PUBLISHED

CHAIN = 50
GROUP = 64


def per_op_us(make: Callable[[mx.array], mx.array], x: mx.array) -> float:
    """Device time of one op, from a chain whose every op depends on the one before."""
    def chain() -> mx.array:
        y = x
        for _ in range(CHAIN):
            y = make(y)
        return y
    mx.eval(chain())  # builds the kernels
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(chain())
        best = min(best, time.perf_counter() - start)
    return round(1e6 * best / CHAIN, 1)


def projection(out_features: int, in_features: int, bits: int, impl: str,
               how: Plan | None = None) -> Callable[[mx.array], mx.array]:
    """x [rows, in] -> [rows, in] through a projection of the given shape (a fold keeps the chain's shape)."""
    w = (mx.random.normal((out_features, in_features)) * 0.02).astype(mx.bfloat16)
    if bits:
        packed, scales, biases = mx.quantize(w, group_size=GROUP, bits=bits)
        mx.eval(packed, scales, biases)
        matmul = {
            "kernel": lambda x: batch_invariant_quantized_matmul(x, packed, scales, biases, GROUP, bits),
            "tc": lambda x: tensor_core_matmul(x, packed, scales, biases, GROUP, bits, how),
            "mlx": lambda x: mx.quantized_matmul(x, packed, scales, biases, transpose=True, group_size=GROUP, bits=bits),
        }[impl]
    else:
        mx.eval(w)
        matmul = {"kernel": lambda x: batch_invariant_matmul(x, w),
                  "tc": lambda x: tensor_core_matmul(x, w, bits=16, how=how), "mlx": lambda x: x @ w.T}[impl]
    return lambda x: fold(matmul(x), in_features)


def fold(y: mx.array, width: int) -> mx.array:
    """The first ``width`` columns, or ``y`` tiled to them: a cheap view that keeps a chain's input shape."""
    if y.shape[-1] >= width:
        return y[..., :width]
    return mx.concatenate([y] * (width // y.shape[-1]), axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b", choices=sorted(PUBLISHED))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--bits", nargs="+", type=int, default=[4, 0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--impl", nargs="+", choices=["mlx", "kernel", "tc"], default=["mlx"])
    parser.add_argument("--plans", nargs="+", default=[], metavar="SPLIT,UNROLL,TILES,WARPS_N[,ROW_TILES]",
                        help="with --impl tc: time the projections alone under each plan")
    args = parser.parse_args()
    c = PUBLISHED[args.model]
    hidden, inter, heads, kv_heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", hidden // heads)
    vocab = c["vocab_size"]
    qkv = (heads + 2 * kv_heads) * head_dim
    shapes = {"qkv": (qkv, hidden), "o": (hidden, heads * head_dim), "gate_up": (2 * inter, hidden),
              "down": (hidden, inter), "lm_head": (vocab, hidden)}
    if args.plans:
        sweep_plans(shapes, args)
        return
    for impl, bits in ((impl, bits) for bits in args.bits for impl in args.impl):
        ops = {name: projection(n, k, bits, impl) for name, (n, k) in shapes.items()}
        keys = mx.random.normal((1, kv_heads, args.context, head_dim)).astype(mx.bfloat16)
        values = mx.random.normal((1, kv_heads, args.context, head_dim)).astype(mx.bfloat16)
        norm_w = mx.ones((hidden,), dtype=mx.bfloat16)
        for rows in args.rows:
            x = (mx.random.normal((rows, hidden)) * 0.1).astype(mx.bfloat16)
            row = {name: per_op_us(op, (mx.random.normal((rows, shapes[name][1])) * 0.1).astype(mx.bfloat16))
                   for name, op in ops.items()}
            q = mx.random.normal((1, heads, rows, head_dim)).astype(mx.bfloat16)
            mask = "causal" if rows > 1 else None
            row["attention"] = per_op_us(
                lambda q: mx.fast.scaled_dot_product_attention(q, keys, values, scale=head_dim ** -0.5, mask=mask), q)
            row["rms_norm"] = per_op_us(lambda x: mx.fast.rms_norm(x, norm_w, 1e-6), x)
            layer = row["qkv"] + row["o"] + row["gate_up"] + row["down"] + row["attention"] + 2 * row["rms_norm"]
            row["layers_ms"] = round(c["num_hidden_layers"] * layer / 1e3, 2)
            row["forward_ms"] = round(row["layers_ms"] + row["lm_head"] / 1e3, 2)
            print(json.dumps({"model": args.model, "bits": bits or "bf16", "impl": impl, "rows": rows, "us_per_op": row}), flush=True)


def sweep_plans(shapes: dict[str, tuple[int, int]], args: argparse.Namespace) -> None:
    """Device microseconds of each projection under each plan of the tensor-core kernel."""
    for bits in args.bits:
        for name, (n, k) in shapes.items():
            for text in args.plans:
                how = Plan(*(int(v) for v in text.split(",")))
                op = projection(n, k, bits, "tc", how)
                try:
                    us = {rows: per_op_us(op, (mx.random.normal((rows, k)) * 0.1).astype(mx.bfloat16)) for rows in args.rows}
                except RuntimeError as error:  # a plan a block cannot launch
                    us = {"error": str(error)[:80]}
                print(json.dumps({"bits": bits or "bf16", "op": name, "plan": text, "us_by_rows": us}), flush=True)


if __name__ == "__main__":
    main()
