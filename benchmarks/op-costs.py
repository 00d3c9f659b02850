"""What one op of each kind a round uses costs the host, and the device, on this machine.

A round of this small model is bound by the host (README, issue #4): MLX spends
microseconds queueing each op. This times chains of ``CHAIN`` ops of one kind at a
round's shapes (16 rows, SmolLM2-135M's widths), so a change that swaps one kind of op for
another can be judged before it is written:

    PYTHONPATH=. python benchmarks/op-costs.py            # on the GPU machine, after warm-up

Per op: the host's time inside ``mx.async_eval`` of an already built eager graph, the
same with the graph built and queued by an ``mx.compile``d chain (what the engine's steps
do), and wall time to the result (host and device together).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import mlx.core as mx

from runtime.branches import RANKS, best_tokens
from runtime.models.attention import cache_attention, uses_kernel

CHAIN = 64
REPS = 12
ROWS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, KEYS = 16, 576, 9, 3, 64, 256
VOCAB = 49152
DTYPE = mx.float16


def custom_add() -> Callable[[mx.array, mx.array], mx.array] | None:
    """An elementwise add as a custom kernel (CUDA only): what a hand-fused op would cost."""
    if not hasattr(mx.fast, "cuda_kernel") or mx.default_device() != mx.gpu:
        return None
    kernel = mx.fast.cuda_kernel(
        name="op_costs_add", input_names=["a", "b"], output_names=["out"],
        source="auto i = cooperative_groups::this_grid().thread_rank(); if (i < a_shape[0] * a_shape[1]) out[i] = a[i] + b[i];",
    )

    def add(a: mx.array, b: mx.array) -> mx.array:
        return kernel(inputs=[a, b], template=[("T", a.dtype)], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=[a.shape], output_dtypes=[a.dtype])[0]
    return add


def steps() -> dict[str, tuple[Callable[[mx.array], mx.array], mx.array, int]]:
    """name -> (one link of the chain, its input, ops in a link)."""
    r = lambda *shape: mx.random.normal(shape).astype(DTYPE)  # noqa: E731
    x, b, w, norm_w = r(ROWS, HIDDEN), r(ROWS, HIDDEN), r(HIDDEN, HIDDEN) * 0.04, mx.ones((HIDDEN,), DTYPE)
    q4 = mx.quantize(w, group_size=64, bits=4)
    q8 = mx.quantize(w, group_size=64, bits=8)
    heads = r(1, HEADS, ROWS, HEAD_DIM)
    keys, values = r(1, KV_HEADS, KEYS, HEAD_DIM), r(1, KV_HEADS, KEYS, HEAD_DIM)
    mask = mx.arange(KEYS)[None, :] <= (200 + mx.arange(ROWS))[:, None]
    offset = mx.array(200, dtype=mx.int32)
    cache, update = r(1, KV_HEADS, 2 * KEYS, HEAD_DIM), r(1, KV_HEADS, ROWS, HEAD_DIM)
    table: dict[str, tuple[Callable[[mx.array], mx.array], mx.array, int]] = {
        "add": (lambda y: y + b, x, 1),
        "rms_norm": (lambda y: mx.fast.rms_norm(y, norm_w, 1e-5), x, 1),
        "reshape (view)": (lambda y: y.reshape(ROWS, HEADS, HEAD_DIM).reshape(ROWS, HIDDEN), x, 2),
        "transpose (view)": (lambda y: y.T, x, 1),
        "heads out (transpose, reshape: a copy)": (
            lambda y: y.reshape(ROWS, HEADS, HEAD_DIM).transpose(1, 0, 2).reshape(ROWS, HIDDEN), x, 3),
        "rope (device offset)": (lambda y: mx.fast.rope(y, HEAD_DIM, traditional=False, base=1e4, scale=1.0, offset=offset), heads, 1),
        "matmul dense": (lambda y: y @ w, x, 1),
        "quantized matmul 4-bit": (lambda y: mx.quantized_matmul(y, *q4, transpose=True, group_size=64, bits=4), x, 1),
        "quantized matmul 8-bit": (lambda y: mx.quantized_matmul(y, *q8, transpose=True, group_size=64, bits=8), x, 1),
        "sdpa, mask array": (lambda y: mx.fast.scaled_dot_product_attention(y, keys, values, scale=0.125, mask=mask), heads, 1),
        "slice_update at device offset": (lambda c: mx.slice_update(c, update, offset, axes=(2,)), cache, 1),
    }
    logits = r(ROWS - 1, VOCAB)  # a draft's rows: a round's runner-up tokens come from them (runtime/branches.py)
    table.update({  # a whole link each (its ops counted as one): the top tokens, then a zero add that chains them
        "top-4 of a vocab by argpartition (a link)": (
            lambda y: y + mx.argpartition(-y, kth=RANKS - 1, axis=-1)[..., :1].astype(y.dtype) * 0, logits, 1),
        "top-4 of a vocab by 4 argmax (a link)": (
            lambda y: y + best_tokens(y, RANKS)[..., :1].astype(y.dtype) * 0, logits, 1),
    })
    add = custom_add()
    if add is not None:
        table["custom kernel add"] = (lambda y: add(y, b), x, 1)
    length = mx.array(200, dtype=mx.int32)
    if uses_kernel(ROWS, HEAD_DIM, DTYPE, 0.125):  # its [1, L, H, D] read back as [1, H, L, D]: a view
        table["attention kernel, device length (+ a view)"] = (
            lambda y: cache_attention(y, keys, values, length, causal=True, scale=0.125).reshape(heads.shape), heads, 2)
    return table


def chain(link: Callable[[mx.array], mx.array], n: int) -> Callable[[mx.array], mx.array]:
    def run(y: mx.array) -> mx.array:
        for _ in range(n):
            y = link(y)
        return y
    return run


def timed(queue: Callable[[], mx.array]) -> tuple[float, float]:
    """Median seconds of (queueing, queueing to result) over REPS, after warm-up."""
    host, wall = [], []
    for i in range(REPS + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        out = queue()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        if i >= 3:
            host.append(t1 - t0)
            wall.append(t2 - t0)
    return statistics.median(host), statistics.median(wall)


def measure(link: Callable[[mx.array], mx.array], x: mx.array) -> dict[str, float]:
    run = chain(link, CHAIN)
    mx.eval(x)
    graphs = [run(x) for _ in range(REPS + 3)]  # built before the clock starts: async_eval alone is timed
    eager_host, eager_wall = timed(lambda: _queued(graphs.pop()))
    compiled = mx.compile(run)
    compiled_host, compiled_wall = timed(lambda: _queued(compiled(x)))
    return {"eager_host": eager_host, "eager_wall": eager_wall, "compiled_host": compiled_host, "compiled_wall": compiled_wall}


def _queued(out: mx.array) -> mx.array:
    mx.async_eval(out)
    return out


def main() -> None:
    print(f"device {mx.default_device()}  mlx {mx.__version__}  chains of {CHAIN} links, median of {REPS}")
    print(f"{'op':42s} {'ops':>4s} {'eager host us/op':>17s} {'eager wall us/op':>17s} {'compiled host us/op':>20s} {'compiled wall us/op':>20s}")
    for name, (link, x, ops) in steps().items():
        m = measure(link, x)
        per = 1e6 / (CHAIN * ops)
        print(f"{name:42s} {ops:4d} {m['eager_host'] * per:17.2f} {m['eager_wall'] * per:17.2f} "
              f"{m['compiled_host'] * per:20.2f} {m['compiled_wall'] * per:20.2f}", flush=True)


if __name__ == "__main__":
    main()
