"""Whether a cache write copies its whole buffer while an earlier graph that reads it is in flight.

A KV cache append is ``mx.slice_update`` at a device offset: MLX writes in place only when
the buffer is donatable, i.e. nothing else holds it. A graph still queued on the device holds
its inputs until it completes, so in the pipelined modes the write of round N+1 may copy the
whole buffer that round N is still reading (issue #4's notes). This times chains of
append-then-read steps on a buffer the size of one layer's keys, three ways: each step
waited for (sequential), the previous step read while the next is queued (pipelined), and
nothing read until the end; the peak memory above the buffer shows the copies:

    PYTHONPATH=. python benchmarks/donation.py          # on the CPU or on the GPU machine
"""

from __future__ import annotations

import time

import mlx.core as mx

HEADS, HEAD_DIM, ROWS_PER_STEP, STEPS = 3, 64, 16, 200  # SmolLM2-135M's KV heads; a block's rows


def chain(positions: int, pattern: str, steps: int) -> tuple[float, float, float]:
    """ms a step, of it ms inside ``mx.async_eval``, and peak memory above the start (MB)."""
    buf = mx.zeros((1, HEADS, positions, HEAD_DIM), mx.float16)
    rows = mx.ones((1, HEADS, ROWS_PER_STEP, HEAD_DIM), mx.float16)
    mx.eval(buf)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    previous, queued = None, 0.0
    start = time.perf_counter()
    for i in range(steps):
        offset = mx.array([(i % (positions // ROWS_PER_STEP - 1)) * ROWS_PER_STEP])
        buf = mx.slice_update(buf, rows, offset, axes=(2,))
        read = mx.sum(buf[..., :ROWS_PER_STEP, :])  # stands in for attention over the cache
        if pattern == "waited":
            mx.eval(buf, read)
            continue
        t = time.perf_counter()
        mx.async_eval(buf, read)
        queued += time.perf_counter() - t
        if pattern == "read previous" and previous is not None:
            previous.item()
        previous = read
    mx.eval(buf)
    mx.synchronize()
    per_step = (time.perf_counter() - start) * 1e3 / steps
    return per_step, queued * 1e3 / steps, (mx.get_peak_memory() - base) / 2**20


def main() -> None:
    print("device:", mx.default_device())
    for positions in (512, 4096, 65536):
        size = positions * HEADS * HEAD_DIM * 2 / 2**20
        for pattern in ("waited", "read previous", "queued"):
            chain(positions, pattern, 5)  # kernels built
            ms, queued, peak = chain(positions, pattern, STEPS)
            print(f"buffer {size:6.2f} MB, {pattern:13s}: {ms:.4f} ms a step ({queued:.4f} in async_eval), "
                  f"peak memory +{peak:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
