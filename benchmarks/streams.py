"""The actor engine's aggregate throughput by concurrent requests: whether batched rounds scale.

    PYTHONPATH=. python benchmarks/streams.py [--model M] [--dtype D] [--draft DIR] \\
        [--prompts P.jsonl] [--streams 1 8 16 32] [--max-tokens 128] [--repeat 2]

Runs the pipelined engine over the same prompts (as many as the largest N) for each N of
``--streams``, N at once (their rounds share forwards, as the server's do), wave after wave,
with no HTTP in between, so the figure is the engine's own: aggregate decode tokens/s over the
same tokens at every N, the round's time, requests per verify forward. Each N runs
``--repeat`` times after a warm-up pass; the best is printed. A round whose host cost
grows with its requests shows as ``round_ms`` growing with N (issue #24: serving throughput
flattened after 8 streams).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import anyio

from protocol import GenerationParams
from runtime.bench import DEFAULT_PROMPTS, engine_summary, read_prompts, run_together
from runtime.cli import add_model_arguments
from runtime.defaults import default_model_path
from runtime.drafters import resolve_drafter
from runtime.loading import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--draft", default="default", help="drafter folder, random:L, or default (the bundled one)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 8, 16, 32])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--mode", default="pipelined")
    args = parser.parse_args()
    target = load_target(args.model or default_model_path(), dtype=args.dtype)
    drafter = resolve_drafter(None if args.draft == "default" else args.draft, target, block_size=args.block_size)
    read = [ids for _, ids in read_prompts(args.prompts, target)]
    prompts = [read[i % len(read)] for i in range(max(args.streams))]
    params = GenerationParams(max_tokens=args.max_tokens)
    for n in sorted(set(args.streams)):  # warm-up: every batch shape's kernels built before timing
        anyio.run(run_together, target, drafter, prompts[:n], params, args.mode)
    base = None
    for n in args.streams:
        waves = [prompts[i : i + n] for i in range(0, len(prompts), n)]
        runs = [engine_summary([anyio.run(run_together, target, drafter, wave, params, args.mode) for wave in waves])
                for _ in range(args.repeat)]
        best = max(runs, key=lambda r: r["tokens_per_s"])
        base = base or best["tokens_per_s"]
        print(json.dumps({"streams": n, "tokens_per_s": best["tokens_per_s"], "x_one_stream": round(best["tokens_per_s"] / base, 2),
                          "round_ms": best["round_ms"], "mean_batch_size": best["mean_batch_size"], "tau": best["tau"],
                          "runs_tokens_per_s": [r["tokens_per_s"] for r in runs]}), flush=True)


if __name__ == "__main__":
    main()
