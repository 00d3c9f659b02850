"""What a whole verify forward costs by its rows: the price of verifying a tree of drafts.

    PYTHONPATH=. python benchmarks/verify-width.py [--dtype bfloat16] [--rows 1 16 32 64 128] [--context 300]

A round that verifies K blocks of 16 runs one target forward over K x 16 rows
(benchmarks/row-confidence.py measures the tau it would buy). This prefills ``--context``
tokens, then times target forwards of each width over that cache (with the bundled
drafter's taps, as a verify takes them), trimming the cache back after each: the median of
``--repeats`` in ms and in one-row forwards. A forward here is built and evaluated alone
(the engine's compiled, pipelined steps hide part of the host's share).
"""

from __future__ import annotations

import argparse
import statistics
import time

import runtime  # noqa: F401  (first: on Linux it binds MLX's CPU matmuls to OpenBLAS before MLX loads)

import mlx.core as mx

from runtime.cache import KVCache, trim_caches
from runtime.defaults import default_drafter_path, default_model_path
from runtime.drafters import resolve_drafter
from runtime.loading import load_target
from runtime.models import DecoderModel

WARM_UP = 3


def forward_ms(model: DecoderModel, cache: list[KVCache], rows: int, taps: tuple[int, ...], repeats: int) -> float:
    """Median ms of a forward over ``rows`` new tokens after the cache's context."""
    tokens = mx.full((1, rows), 100, dtype=mx.int32)  # the token ids do not change the work
    times = []
    for _ in range(WARM_UP + repeats):
        started = time.perf_counter()
        out = model(tokens, cache, tap_layers=taps)
        mx.eval(out.logits, out.taps)
        times.append((time.perf_counter() - started) * 1e3)
        trim_caches(cache, rows)
    return statistics.median(times[WARM_UP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 16, 32, 64, 128])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    target = load_target(default_model_path(), dtype=args.dtype)
    taps = resolve_drafter(str(default_drafter_path()), target, block_size=16).tap_layers
    cache = target.model.make_cache()
    mx.eval(target.model(mx.full((1, args.context), 100, dtype=mx.int32), cache).logits)
    ms = {rows: forward_ms(target.model, cache, rows, taps, args.repeats) for rows in sorted({1, *args.rows})}
    print(f"{target.compute_dtype}, {args.context} tokens of context, device {mx.default_device()}")
    for rows in args.rows:
        print(f"  {rows:4d} rows: {ms[rows]:7.2f} ms = {ms[rows] / ms[1]:5.2f} one-row forwards")


if __name__ == "__main__":
    main()
