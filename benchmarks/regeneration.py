"""How fast the target regenerates training responses, by batch size, with and without dropping finished rows.

Every drafter training run first has the target answer every prompt (runtime.training.data.greedy_batch);
on the H200 that was about 165 prompts/s for SmolLM2-135M (session 18), a quarter of a session's
device time. This times it on the same prompts at each batch size asked, longest prompts first as
training does, and once more with finished rows kept in the batch (the behaviour before session 18):

    PYTHONPATH=. python benchmarks/regeneration.py --prompts runs/prompts/train-v12.jsonl --count 4096 \\
        --batch 512 1024 2048 [--dtype bfloat16] [--max-new-tokens 256]

Each line: batch size, compaction on/off, prompts/s, generated tokens/s, decode steps and ms a step.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import mlx.core as mx

from runtime.defaults import default_model_path
from runtime.loading import load_target
from runtime.models import DecoderModel
from runtime.training import data
from runtime.training.corpora import load_prompts


def run(model: DecoderModel, prompts: list[list[int]], batch: int, max_new: int, stops: frozenset[int]) -> tuple[float, int, int]:
    """Seconds, generated tokens and decode steps for regenerating ``prompts`` ``batch`` at a time."""
    tokens = steps = 0
    start = time.perf_counter()
    for rows in data.length_sorted_batches([len(p) for p in prompts], batch):
        outputs = data.greedy_batch(model, [prompts[i] for i in rows], max_new, stops)
        tokens += sum(map(len, outputs))
        steps += max(map(len, outputs))
    return time.perf_counter() - start, tokens, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="a JSONL of prompts (runtime.training.export)")
    parser.add_argument("--count", type=int, default=4096)
    parser.add_argument("--batch", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", help="as runtime.train computes: bfloat16 on a GPU")
    args = parser.parse_args()
    target = load_target(default_model_path(), dtype=args.dtype)
    prompts = [data.render_prompt(p, target.tokenizer) for p in load_prompts([str(args.prompts)], args.count, seed=0)]
    stops = target.tokenizer.eos_token_ids
    run(target.model, prompts[: min(args.batch)], min(args.batch), 8, stops)  # build the kernels once
    print(f"device {mx.default_device()}, {len(prompts)} prompts, up to {args.max_new_tokens} new tokens each")
    for batch in args.batch:
        for compact in (True, False):
            data.COMPACT_BELOW = 0.75 if compact else 0.0  # 0: a batch keeps its finished rows
            seconds, tokens, steps = run(target.model, prompts, batch, args.max_new_tokens, stops)
            print(f"batch {batch:5} compaction {'on ' if compact else 'off'}: {len(prompts) / seconds:7.1f} prompts/s, "
                  f"{tokens / seconds:9.0f} tokens/s, {steps} steps, {1000 * seconds / steps:6.1f} ms a step", flush=True)


if __name__ == "__main__":
    main()
