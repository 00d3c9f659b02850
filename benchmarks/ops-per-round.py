"""Device ops a batched round builds, by streams: whether a round's host cost grows with its requests.

    PYTHONPATH=. python benchmarks/ops-per-round.py [--streams 1 8 32] [--layers 4] [--tau 3]

On a GPU every op of a round's graph is host work (building it, launching its kernel), so a round
whose graph grows with the batch pays per request what the batching was meant to share. This runs
the pipelined engine over a small random Qwen3-shaped target (``runtime.random_targets``, the
oracle drafter at ``--tau``: a measuring instrument) on any machine, and counts the ops of every
graph the drafter's and verifier's steps hand to ``mx.async_eval`` (``mx.export_to_dot``'s
primitive nodes). Printed per streams: min / median / max ops per draft step, verify step and
prefill, and the mean; the median is the steady round (the max: newcomers' first rounds).
``--stagger S`` gives request i ``S * i`` more tokens, so requests leave one after another
while the others decode, as a server's do.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
from collections import defaultdict
from typing import Any

import anyio
import mlx.core as mx

from protocol import GenerationParams
from runtime.bench import oracle_drafter
from runtime.engine import Engine
from runtime.loading import load_checkpoint
from runtime.random_targets import random_checkpoint

STEPS = {"_draft": "draft", "_verify": "verify", "_prefill": "prefill"}


def graph_ops(arrays: tuple[Any, ...]) -> int:
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    return dot.getvalue().count("shape=rectangle")


def counting_async_eval(counts: dict[str, list[int]]) -> Any:
    real = mx.async_eval

    def async_eval(*arrays: Any) -> None:
        step = STEPS.get(sys._getframe(1).f_code.co_name)
        if step:
            counts[step].append(graph_ops(arrays))
        real(*arrays)
    return async_eval


async def run_each(target: Any, drafter: Any, prompts: list[list[int]], params: list[GenerationParams]) -> None:
    """All the prompts at once through one engine, each with its own params."""
    async def one(ids: list[int], p: GenerationParams, engine: Engine) -> None:
        async for _ in engine.generate(ids, p):
            pass

    async with Engine(target, drafter, mode="pipelined") as engine, anyio.create_task_group() as group:
        for ids, p in zip(prompts, params):
            group.start_soon(one, ids, p, engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--layers", type=int, default=4, help="target layers (the count per layer is the same at any size)")
    parser.add_argument("--tau", type=float, default=3.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--stagger", type=int, default=0)
    args = parser.parse_args()
    small = {"num_hidden_layers": args.layers, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16}
    target = load_checkpoint(random_checkpoint("random:qwen3-8b", overrides=small), dtype="float32")
    drafter = oracle_drafter(target, "random:2", args.tau, 16)
    prompts = [[(7 * i + j) % 200 + 32 for j in range(12 + i % 5)] for i in range(max(args.streams))]
    counts: dict[str, list[int]] = defaultdict(list)
    mx.async_eval = counting_async_eval(counts)
    for n in args.streams:
        counts.clear()
        params = [GenerationParams(max_tokens=args.max_tokens + args.stagger * i) for i in range(n)]
        anyio.run(run_each, target, drafter, prompts[:n], params)
        row = {step: [min(v), statistics.median(v), max(v), round(statistics.mean(v))] for step, v in counts.items()}
        print(json.dumps({"streams": n, "ops_min_median_max_mean": row}), flush=True)


if __name__ == "__main__":
    main()
