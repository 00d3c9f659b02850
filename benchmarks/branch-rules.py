"""Tau of rounds verifying several blocks, by the rule that picks the blocks (runtime/branches.py).

    PYTHONPATH=. python benchmarks/branch-rules.py --prompts runs/eval8/validation/{code,code-ask,math,chat}.jsonl \
        [--branches 4 8] [--rules shapes confidence] [--max-tokens 256]

``confidence``: the runtime's rule, the runner-ups the drafter's own probabilities expect
to gain most each round (``runtime.branches.branch_drafts``); ``shapes``: fixed ranks per
block count (:data:`SHAPES`, the best shapes of teacher-forced rounds, BENCHMARKS.md session
28). The sequential reference loop on the CPU in float32, the bundled drafter, block 16; every
output is checked against plain greedy decoding. The rule is swapped where the drafter takes
it (a measuring instrument).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import mlx.core as mx

import runtime.models.dflash as dflash
from protocol import GenerationParams
from runtime.bench import read_prompts, run_dflash, run_plain
from runtime.branches import branch_drafts
from runtime.defaults import default_model_path
from runtime.drafters import resolve_drafter
from runtime.loading import load_target

# blocks by count: each as the drafter's rank of its token in rows 1, 2, ... (later rows: its best)
SHAPES: dict[int, tuple[tuple[int, ...], ...]] = {
    2: ((0,), (1,)),
    4: ((0,), (1,), (0, 1), (0, 0, 1)),
    8: tuple((i, j) for i in range(4) for j in range(2)),
}


def shape_drafts(logits: mx.array, branches: int) -> mx.array:
    """The blocks ``[R, branches, n]`` of :data:`SHAPES`: fixed ranks, whatever the drafter's confidence."""
    rows, n, _ = logits.shape
    top = 1 + max(max(ranks, default=0) for ranks in SHAPES[branches])
    ranked = mx.argsort(-logits, axis=-1)[..., :top].astype(mx.int32)
    table = mx.array([[ranks[i] if i < len(ranks) else 0 for i in range(n)] for ranks in SHAPES[branches]])
    index = mx.broadcast_to(table[None, :, :, None], (rows, branches, n, 1))
    return mx.take_along_axis(mx.broadcast_to(ranked[:, None], (rows, branches, n, top)), index, axis=-1)[..., 0]


RULES = {"confidence": branch_drafts, "shapes": shape_drafts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", nargs="+", required=True, type=Path)
    parser.add_argument("--branches", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--rules", nargs="+", choices=sorted(RULES), default=sorted(RULES))
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    target = load_target(default_model_path(), dtype="float32")
    drafter = resolve_drafter(None, target, block_size=16)
    params = GenerationParams(max_tokens=args.max_tokens, block_size=16)
    for path in args.prompts:
        prompts = [ids for _, ids in read_prompts(path, target)]
        want = [run_plain(target, ids, params).token_ids for ids in prompts]
        for rule in args.rules:
            dflash.branch_drafts = RULES[rule]
            for k in args.branches:
                runs = [run_dflash(target, drafter, ids, params, k) for ids in prompts]
                delivered = sum(r.delivered for _, stats in runs for r in stats.rounds)
                rounds = sum(len(stats.rounds) for _, stats in runs)
                equal = sum(result.token_ids == w for (result, _), w in zip(runs, want))
                print(f"{path.stem} {rule} {k} blocks: tau {delivered / rounds:.3f}, equal to plain greedy {equal}/{len(want)}",
                      flush=True)


if __name__ == "__main__":
    main()
