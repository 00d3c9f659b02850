"""The batch-invariant kernel's cost against MLX's matmul, at SmolLM2's and 8B models' projection shapes.

    PYTHONPATH=. python benchmarks/batch-invariant.py

Per shape ``[out x in]`` (bf16, then 4-bit affine with group 64 and fp16 activations) and rows (1: a decode step; 16: one request's verify; 64, 256:
batched verifies), device microseconds per call in a chain of 100: MLX's matmul, then the
kernel with 8 and 16 rows per weight read; and whether the kernel's rows equal a lone row's.
"""

from __future__ import annotations

import json
import time

import mlx.core as mx

from runtime.models.batch_invariant import batch_invariant_matmul, batch_invariant_quantized_matmul

SHAPES = {"8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate_up": (24576, 4096), "8b down": (4096, 12288),
          "qwen3-8b head": (151936, 4096), "smollm2 o": (576, 576), "smollm2 down": (576, 1536),
          "smollm2 head": (49152, 576)}


def chain_us(step, n: int = 100) -> float:
    mx.eval(step())
    start = time.perf_counter()
    mx.eval([step() for _ in range(n)])
    return round(1e6 * (time.perf_counter() - start) / n, 1)


def compare(name: str, kind: str, k: int, theirs, ours) -> None:
    """theirs(x), ours(x, rows_per_pass): one JSON line per row count."""
    for rows in (1, 16, 64, 256):
        x = mx.random.normal((rows, k)).astype(mx.bfloat16 if kind == "bf16" else mx.float16)
        row = {"shape": name, "kind": kind, "rows": rows, "mlx_us": chain_us(lambda: theirs(x))}
        for per_pass in (8, 16):
            row[f"kernel{per_pass}_us"] = chain_us(lambda: ours(x, per_pass))
        row["row0_equal_alone"] = bool(mx.array_equal(ours(x, 8)[:1], ours(x[:1], 8)))
        print(json.dumps(row), flush=True)


def main() -> None:
    for name, (n, k) in SHAPES.items():
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        compare(name, "bf16", k, lambda x: x @ w.T, lambda x, p: batch_invariant_matmul(x, w, p))
        q, s, b = mx.quantize(w.astype(mx.float32), group_size=64, bits=4)
        s, b = s.astype(mx.float16), b.astype(mx.float16)
        del w
        compare(name, "4-bit", k, lambda x: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4),
                lambda x, p: batch_invariant_quantized_matmul(x, q, s, b, 64, 4, p))


if __name__ == "__main__":
    main()
