"""Where the actor engine's host time goes, per round: one mode over the bench prompts.

    PYTHONPATH=. python benchmarks/engine-parts.py MODE SECONDS [DTYPE] [DRAFTER] [--parts]
    (MODE: pipelined, sequential or pipelined2; DRAFTER default random:5; TOKENS, PROMPTS env)

Runs the engine on the bundled bench prompts (block 16) until SECONDS have passed and prints
each pass's round time. With ``--parts``, the actors' steps and ``mx.async_eval`` are timed
(wall time inside each call; the async steps' figures include what other tasks ran while
they awaited): figures per round, for comparing modes, not for adding up.
Run it under ``py-spy record --native`` to sample MLX's own frames as well.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import sys
import time
from typing import Any

import runtime  # noqa: F401  (first: on Linux it binds MLX's CPU matmuls to OpenBLAS before MLX loads)

import anyio
import mlx.core as mx

import actors.committer
import actors.drafter
import actors.verifier
import runtime.batching
from protocol import GenerationParams
from runtime.bench import DEFAULT_PROMPTS, read_prompts, run_engine
from runtime.defaults import default_model_path
from runtime.drafters import resolve_drafter
from runtime.loading import load_target

spent: collections.Counter[str] = collections.Counter()
calls: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, label: str | None = None) -> None:
    """Replace ``owner.name`` by a wrapper that adds its wall time to ``spent``."""
    fn, label = getattr(owner, name), label or f"{owner.__name__}.{name}"

    def record(started: float) -> None:
        spent[label] += time.perf_counter() - started
        calls[label] += 1

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                record(started)
    else:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record(started)
    setattr(owner, name, wrapper)


class TimedMLX:
    """``mlx.core`` as the actors see it, with ``async_eval`` timed."""

    def __init__(self) -> None:
        timed(self, "async_eval", "mx.async_eval")

    @staticmethod
    def async_eval(*arrays: Any) -> None:
        mx.async_eval(*arrays)

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)


def time_parts() -> None:
    for owner, names in ((actors.drafter.Drafter, ("_draft", "_forward")), (actors.verifier.Verifier, ("_verify",)),
                         (actors.committer.Committer, ("_commit_round", "_facts", "_emit")),
                         (runtime.batching.HostReadout, ("row",))):
        for name in names:
            timed(owner, name)
    actors.drafter.mx = actors.verifier.mx = TimedMLX()  # type: ignore[assignment]


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--parts"]
    mode, seconds = args[0], float(args[1])
    target = load_target(default_model_path(), dtype=args[2] if len(args) > 2 else "auto")
    drafter = resolve_drafter(args[3] if len(args) > 3 else "random:5", target, block_size=16)
    ids = [p for _, p in read_prompts(DEFAULT_PROMPTS, target)][: int(os.environ.get("PROMPTS", 5))]
    params = GenerationParams(max_tokens=int(os.environ.get("TOKENS", 128)), block_size=16)
    anyio.run(run_engine, target, drafter, ids, params, mode)  # builds every kernel and compiled step first
    print("warm", flush=True)
    if "--parts" in sys.argv:
        time_parts()
    started, rounds, decode = time.perf_counter(), 0, 0.0
    while rounds == 0 or time.perf_counter() - started < seconds:  # at least one pass
        out = anyio.run(run_engine, target, drafter, ids, params, mode)
        n, s = sum(int(e.stats["rounds"]) for _, e in out), sum(e.timings["decode_s"] for _, e in out)
        rounds, decode = rounds + n, decode + s
        print(f"{mode}: {sum(len(t) - 1 for t, _ in out) / s:.1f} tok/s, {1e3 * s / n:.3f} ms a round", flush=True)
    print(f"{mode}: {rounds} rounds, {1e3 * decode / rounds:.3f} ms a round")
    for label, total in spent.most_common():
        print(f"  {label:36s} {1e3 * total / rounds:8.3f} ms a round ({calls[label] / rounds:.2f} calls)")


if __name__ == "__main__":
    main()
