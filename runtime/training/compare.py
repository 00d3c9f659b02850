"""``python -m runtime.training.compare --drafts A B ... --prompts SET.jsonl ...``: drafters side by side.

Which checkpoint of a training run to bundle is decided by its tau on the held-out sets;
``runtime.bench --no-engine`` gives one drafter's, but decodes every set plainly again
for each drafter. This loads the target once, decodes each set plainly once, then runs
every drafter's reference loop on it: a table of tau per drafter and set, and how many
outputs equal plain greedy's (float32, on the GPU machine too, gives the CPU's figures
but for rare near-ties). Progress goes to stderr; ``--json`` prints the table as JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from protocol import GenerationParams

from ..bench import read_prompts, run_dflash, run_plain
from ..cli import add_model_arguments, new_parser, print_json, run_cli
from ..defaults import default_model_path
from ..drafters import resolve_drafter
from ..loading import LoadedModel, load_target
from ..models.dflash import DFlashDrafter
from ..speculative import SpeculativeStats, block_size_for
from .splits import split_of


def drafter_on_set(target: LoadedModel, drafter: DFlashDrafter, prompts: list[list[int]], want: list[list[int]],
                   params: GenerationParams) -> dict[str, Any]:
    """tau over all the set's rounds pooled (as bench reports it) and the outputs equal to ``want``."""
    results = [run_dflash(target, drafter, ids, params) for ids in prompts]
    merged = SpeculativeStats([r for _, s in results for r in s.rounds])
    summary = merged.summary(block_size_for(drafter, params))
    equal = sum(r.token_ids == w for (r, _), w in zip(results, want))
    return {"tau": round(float(summary["tau"]), 3), "equal": equal, "prompts": len(prompts)}


def compare(target: LoadedModel, drafts: list[str], sets: list[Path], params: GenerationParams) -> dict[str, Any]:
    drafters = {spec: resolve_drafter(spec, target, block_size=params.block_size or 16) for spec in drafts}
    table: dict[str, dict[str, Any]] = {spec: {} for spec in drafts}
    for path in sets:
        prompts = [ids for _, ids in read_prompts(path, target)]
        warm = msgspec.structs.replace(params, max_tokens=8)
        run_plain(target, prompts[0], warm)  # kernel builds are not a set's time
        started = time.perf_counter()
        want = [run_plain(target, ids, params).token_ids for ids in prompts]
        print(f"{path.stem}: plain decoding of {len(prompts)} prompts in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        for spec, drafter in drafters.items():
            table[spec][path.stem] = row = drafter_on_set(target, drafter, prompts, want, params)
            print(f"  {spec}: tau {row['tau']:.3f}, {row['equal']}/{row['prompts']} equal", file=sys.stderr)
    return {"dtype": target.compute_dtype, "max_tokens": params.max_tokens, "block_size": params.block_size,
            "splits": {path.stem: split_of(path) for path in sets}, "drafters": table}


def print_table(report: dict[str, Any], sets: list[Path]) -> None:
    names = [p.stem for p in sets]
    width = max(len(spec) for spec in report["drafters"])
    print(f"tau ({report['dtype']}, block {report['block_size']}, {report['max_tokens']} tokens; equal to plain greedy)")
    print(f"{'split':<{width}} " + " ".join(f"{report['splits'][name]:>16}" for name in names))
    print(f"{'drafter':<{width}} " + " ".join(f"{name:>16}" for name in names))
    for spec, row in report["drafters"].items():
        cells = [f"{row[n]['tau']:.3f} ({row[n]['equal']}/{row[n]['prompts']})" for n in names]
        print(f"{spec:<{width}} " + " ".join(f"{c:>16}" for c in cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser("python -m runtime.training.compare", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--drafts", nargs="+", required=True, metavar="DRAFTER", help="drafter folders (or random:L)")
    parser.add_argument("--prompts", nargs="+", required=True, type=Path, metavar="SET", help="JSONL prompt sets")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    target = load_target(args.model or default_model_path(), dtype=args.dtype)
    params = GenerationParams(max_tokens=args.max_tokens, block_size=args.block_size)
    report = compare(target, args.drafts, args.prompts, params)
    print_json(report) if args.json else print_table(report, args.prompts)


if __name__ == "__main__":
    run_cli(main)
