"""``python -m runtime.bench``: plain decoding against DFlash on the same prompts, one table.

    python -m runtime.bench --draft PATH --prompts FILE.jsonl --max-tokens 256 [--block-size B] [--json]

Each prompt runs once per mode after a warm-up (first-run kernel compilation is not
timed). Reported: decode tokens/s (after the first token), time to first token, mean
acceptance length tau, acceptance per block position, the cost of a round's parts, the
speedup over plain decoding, and whether each DFlash output equals plain greedy.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import mlx.core as mx

from protocol import GenerationParams

from .cli import add_model_arguments, print_json, run_cli
from .defaults import default_model_path
from .drafters import resolve_drafter
from .errors import RequestError
from .loading import LoadedModel, load_target
from .models.dflash import DFlashDrafter
from .plain import GenerationResult, generate_plain, run_to_end
from .speculative import SpeculativeStats, block_size_for, generate_speculative

DEFAULT_PROMPTS = Path(__file__).parent / "data" / "bench_prompts.jsonl"


def read_prompts(path: Path, target: LoadedModel) -> list[tuple[str, list[int]]]:
    """JSONL lines with ``prompt`` (raw text) or ``messages`` (chat); returns names and ids."""
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RequestError("prompts", f"{path}:{n} is not JSON ({exc})") from None
        if "messages" in item:
            text, special = target.tokenizer.apply_chat_template(item["messages"]), False
        elif "prompt" in item:
            text, special = item["prompt"], True
        else:
            raise RequestError("prompts", f"{path}:{n} has neither 'prompt' nor 'messages'")
        prompts.append((str(item.get("name", f"line{n}")), target.tokenizer.encode(text, add_special_tokens=special)))
    if not prompts:
        raise RequestError("prompts", f"{path} holds no prompts")
    return prompts


def run_plain(target: LoadedModel, ids: list[int], params: GenerationParams) -> GenerationResult:
    return run_to_end(generate_plain(target.model, target.tokenizer, ids, params), len(ids))


def run_dflash(target: LoadedModel, drafter: DFlashDrafter, ids: list[int], params: GenerationParams) -> tuple[GenerationResult, SpeculativeStats]:
    stats = SpeculativeStats()
    result = run_to_end(generate_speculative(target.model, drafter, target.tokenizer, ids, params, stats), len(ids))
    return result, stats


def round_costs_ms(stats: list[SpeculativeStats]) -> dict[str, float]:
    rounds = [r for s in stats for r in s.rounds]
    return {part: round(1e3 * statistics.mean(r.timings[part] for r in rounds), 3) for part in ("draft_s", "verify_s", "host_s")} if rounds else {}


def aggregate(results: list[GenerationResult]) -> dict[str, float]:
    tokens = sum(max(0, len(r.token_ids) - 1) for r in results)
    decode = sum(r.decode_s for r in results)
    return {
        "tokens_per_s": round(tokens / decode, 2) if decode else 0.0,
        "ttft_ms": round(1e3 * statistics.mean(r.ttft_s for r in results), 2),
        "tokens": sum(len(r.token_ids) for r in results),
    }


def bench(target: LoadedModel, drafter: DFlashDrafter, prompts: list[tuple[str, list[int]]], params: GenerationParams) -> dict[str, Any]:
    warm = GenerationParams(max_tokens=8, block_size=params.block_size)
    run_plain(target, prompts[0][1], warm)
    run_dflash(target, drafter, prompts[0][1], warm)
    plain_results, dflash_results, all_stats, exact = [], [], [], []
    for _, ids in prompts:
        p = run_plain(target, ids, params)
        d, stats = run_dflash(target, drafter, ids, params)
        plain_results.append(p)
        dflash_results.append(d)
        all_stats.append(stats)
        exact.append(p.token_ids == d.token_ids)
    block = block_size_for(drafter, params)
    merged = SpeculativeStats([r for s in all_stats for r in s.rounds])
    plain, dflash = aggregate(plain_results), {**aggregate(dflash_results), **merged.summary(block)}
    dflash["round_ms"] = round_costs_ms(all_stats)
    return {
        "device": str(mx.default_device()), "block_size": block, "max_tokens": params.max_tokens,
        "prompts": len(prompts), "plain": plain, "dflash": dflash,
        "speedup": round(dflash["tokens_per_s"] / plain["tokens_per_s"], 3) if plain["tokens_per_s"] else 0.0,
        "exact": all(exact), "exact_per_prompt": exact,
    }


def print_table(report: dict[str, Any]) -> None:
    p, d = report["plain"], report["dflash"]
    print(f"device {report['device']}, {report['prompts']} prompts, max_tokens {report['max_tokens']}, block {report['block_size']}")
    print(f"{'mode':<8} {'tok/s':>9} {'ttft ms':>9} {'tau':>6} {'speedup':>8} {'exact':>6}")
    print(f"{'plain':<8} {p['tokens_per_s']:>9.2f} {p['ttft_ms']:>9.1f} {'':>6} {1.0:>8.2f} {'':>6}")
    print(f"{'dflash':<8} {d['tokens_per_s']:>9.2f} {d['ttft_ms']:>9.1f} {d['tau']:>6.2f} {report['speedup']:>8.2f} {str(report['exact']):>6}")
    print("acceptance per block position:", " ".join(f"{x:.2f}" for x in d["acceptance_per_position"]))
    print("round parts (ms):", ", ".join(f"{k[:-2]} {v}" for k, v in d["round_ms"].items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime.bench", description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--draft", help="drafter folder, or random:L (default: the bundled drafter)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with 'prompt' or 'messages' per line")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    target = load_target(args.model or default_model_path(), dtype=args.dtype)
    drafter = resolve_drafter(args.draft, target, block_size=args.block_size or 16)
    params = GenerationParams(max_tokens=args.max_tokens, block_size=args.block_size)
    report = bench(target, drafter, read_prompts(args.prompts, target), params)
    print_json(report) if args.json else print_table(report)


if __name__ == "__main__":
    run_cli(main)
