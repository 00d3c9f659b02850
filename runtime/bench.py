"""``python -m runtime.bench``: plain decoding against DFlash on the same prompts, one table.

    python -m runtime.bench --draft PATH --prompts FILE.jsonl --max-tokens 256 [--block-size B] [--json] [--log PATH] [--repeat N]
                            [--concurrency N] [--branches K] [--no-engine]

Modes: ``plain`` (no drafter), ``reference`` (the sequential DFlash loop, which also
times a round's parts), and the actor engine in ``sequential`` (host sync every round),
``pipelined`` (round N+1 queued before round N is read), ``pipelined2`` (rounds N+1 and
N+2 queued before round N is read) and ``draft-ahead`` (round N+1 drafted before round N is
read, verified after) modes; ``dflash`` in the JSON is the pipelined engine.
After a warm-up (kernel builds and compiled-step traces are not timed), each prompt runs
through every mode back to back before the next prompt, and the whole set ``--repeat``
times: the modes share the machine's slow and fast phases, so their ratios hold even where
absolute timings drift. Reported per mode, over all its runs and per run: decode tokens/s
(after the first token), time to first token, mean acceptance length tau, acceptance per
block position, GPU idle time between rounds (a lower bound: the time in which no round
was queued; a device that drains its queue faster than the host fills it idles too, which
this does not see), the speedup over plain decoding, and whether every output equals
plain greedy; the JSON's ``reference.tau_per_prompt`` gives each prompt's own tau (which
prompts a drafter drafts worst). ``--concurrency N`` runs the engine modes on groups of N prompts at once
(their rounds batched into shared forwards: tokens/s is then the group's aggregate, and
the speedup compares it with one plain stream). ``--log`` appends the engine runs' round
logs (every engine mode) to PATH, for ``python -m runtime.replay``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import anyio
import mlx.core as mx
import msgspec
from tqdm import tqdm

from protocol import GenerationParams, TokenEvent

from .blas import blas_in_use
from .branches import MAX_BRANCHES
from .cli import add_model_arguments, new_parser, print_json, run_cli
from .defaults import default_model_path
from .drafters import parse_random_spec, random_drafter, resolve_drafter
from .engine import MODES, Engine
from .errors import RequestError
from .loading import LoadedModel, load_target
from .models.dflash import DFlashDrafter
from .oracle import OracleDrafter
from .plain import GenerationResult, generate_plain, run_to_end
from .random_targets import greedy_successor
from .speculative import SpeculativeStats, block_size_for, generate_speculative
from .training.splits import split_of

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


def run_dflash(target: LoadedModel, drafter: DFlashDrafter, ids: list[int], params: GenerationParams,
               branches: int = 1) -> tuple[GenerationResult, SpeculativeStats]:
    stats = SpeculativeStats()
    result = run_to_end(generate_speculative(target.model, drafter, target.tokenizer, ids, params, stats,
                                             branches=branches), len(ids))
    return result, stats


def first_divergence(want: Sequence[int], got: Sequence[int]) -> int | None:
    """The first token position where ``got`` leaves ``want``; None where they are equal."""
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


def divergence_summary(positions: list[int | None]) -> dict[str, Any]:
    found = [p for p in positions if p is not None]
    return {"median": statistics.median(found) if found else None, "positions": positions}


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


async def run_engine(target: LoadedModel, drafter: DFlashDrafter, prompts: list[list[int]], params: GenerationParams,
                     mode: str, log: Path | None = None, branches: int = 1) -> list[tuple[list[int], TokenEvent]]:
    """Each prompt in turn through the actor engine (one request at a time: latency, not batching)."""
    async with Engine(target, drafter, mode=mode, log=log, branches=branches) as engine:
        results = []
        for ids in prompts:
            tokens: list[int] = []
            async for event in engine.generate(ids, params):
                tokens += event.token_ids
            results.append((tokens, event))
        return results


class EngineGroup(NamedTuple):
    """Requests run at once through one engine, and their decode span."""

    results: list[tuple[list[int], TokenEvent]]
    decode_s: float  # from the group's first token to its last, as the caller received them


async def run_together(target: LoadedModel, drafter: DFlashDrafter, prompts: list[list[int]], params: GenerationParams,
                       mode: str, log: Path | None = None, branches: int = 1) -> EngineGroup:
    """All the prompts at once through one engine (their rounds share batched forwards)."""
    results: list[tuple[list[int], TokenEvent] | None] = [None] * len(prompts)
    first: list[float] = []
    last: list[float] = []

    async def one(i: int, ids: list[int], engine: Engine) -> None:
        tokens: list[int] = []
        async for event in engine.generate(ids, params):
            if event.token_ids and not tokens:
                first.append(time.perf_counter())
            tokens += event.token_ids
        last.append(time.perf_counter())
        results[i] = (tokens, event)

    async with Engine(target, drafter, mode=mode, log=log, branches=branches) as engine, anyio.create_task_group() as group:
        for i, ids in enumerate(prompts):
            group.start_soon(one, i, ids, engine)
    return EngineGroup([r for r in results if r is not None], max(last) - min(first) if first else 0.0)


def engine_summary(groups: list[EngineGroup]) -> dict[str, Any]:
    """Decode tokens/s over the groups' spans (concurrent requests: aggregate throughput); rounds,
    round time and idle time per request."""
    results = [r for g in groups for r in g.results]
    span = sum(g.decode_s for g in groups)
    decode = sum(e.timings["decode_s"] for _, e in results)
    tokens = sum(max(0, len(t) - 1) for t, _ in results)
    rounds = sum(int(e.stats["rounds"]) for _, e in results)  # type: ignore[arg-type]
    accepted = sum(float(e.stats["tau"]) * int(e.stats["rounds"]) for _, e in results)  # type: ignore[arg-type]
    idle = sum(e.timings["gpu_idle_s"] for _, e in results)
    return {
        "tokens_per_s": round(tokens / span, 2) if span else 0.0,
        "ttft_ms": round(1e3 * statistics.mean(e.timings["ttft_s"] for _, e in results), 2),
        "tau": round(accepted / rounds, 3) if rounds else 0.0,
        "rounds": rounds,
        # requests per verify forward: whether a mode keeps concurrent rounds batched
        "mean_batch_size": round(sum(float(e.stats["mean_batch_size"]) * int(e.stats["rounds"])  # type: ignore[arg-type]
                                     for _, e in results) / rounds, 3) if rounds else 0.0,
        "round_ms": round(1e3 * decode / rounds, 3) if rounds else 0.0,
        "gpu_idle_ms_per_round": round(1e3 * idle / rounds, 3) if rounds else 0.0,
        "gpu_idle_fraction": round(idle / decode, 4) if decode else 0.0,
    }


def bench(target: LoadedModel, drafter: DFlashDrafter | None, prompts: list[tuple[str, list[int]]],
          params: GenerationParams, log: Path | None = None, engine: bool = True, repeat: int = 1,
          concurrency: int = 1, modes: Sequence[str] = tuple(MODES), branches: int = 1) -> dict[str, Any]:
    """Every mode on every prompt; with no drafter, plain decoding alone; without ``engine``,
    plain decoding and the reference loop (tau and exactness, quickly on a CPU).
    ``concurrency``: the engine modes run that many prompts at once; ``modes``: which engine modes;
    ``branches``: blocks every round verifies (runtime/branches.py)."""
    if concurrency < 1:
        raise RequestError("concurrency", f"must be at least 1, got {concurrency}")
    if unknown := set(modes) - set(MODES):
        raise RequestError("modes", f"unknown mode(s) {sorted(unknown)}: choose from {sorted(MODES)}")
    modes = list(modes) if engine else []
    ids = [p for _, p in prompts]
    warm_up(target, drafter, ids, params, modes, concurrency, branches)
    runs = timed_runs(target, drafter, ids, params, repeat, modes, log, concurrency, branches)
    plain = runs.pop("plain")
    report: dict[str, Any] = {
        "device": str(mx.default_device()), "blas": blas_in_use(), "dtype": target.compute_dtype, "quantized": target.quantized,
        "max_tokens": params.max_tokens, "prompts": len(prompts), "repeat": repeat, "concurrency": concurrency,
        "branches": branches,
        "plain": {**aggregate(pooled(plain)), "runs_tokens_per_s": [aggregate(run)["tokens_per_s"] for run in plain]},
    }
    if drafter is not None:
        report.update(dflash_report(drafter, params, runs, [r.token_ids for r in plain[0]], [name for name, _ in prompts]))
        fastest = report["dflash" if "dflash" in report else "reference"]["tokens_per_s"]
        report["speedup"] = round(fastest / (report["plain"]["tokens_per_s"] or 1.0), 3)
    return report


def warm_up(target: LoadedModel, drafter: DFlashDrafter | None, ids: list[list[int]], params: GenerationParams,
            modes: Sequence[str], concurrency: int = 1, branches: int = 1) -> None:
    """Build every kernel and compiled step the timed runs need, so no mode pays for them.

    The engines decode the shortest and the longest prompt to the full length, so the
    compiled steps of every buffer size the timed runs reach are traced beforehand (and,
    with concurrency, a first group at the batch size the timed groups use).
    """
    warm = msgspec.structs.replace(params, max_tokens=min(params.max_tokens, 24))
    if sys.stderr.isatty():
        print("warming up: every kernel and compiled step the timed runs need (minutes on a fresh GPU)", file=sys.stderr)
    run_plain(target, ids[0], warm)
    if drafter is None:
        return
    run_dflash(target, drafter, ids[0], warm, branches)
    if modes:
        for mode in modes:
            anyio.run(run_engine, target, drafter, ids[:1], warm, mode, None, branches)
        anyio.run(run_engine, target, drafter, [min(ids, key=len), max(ids, key=len)], params, modes[0], None, branches)
        if concurrency > 1:
            for mode in modes:
                anyio.run(run_together, target, drafter, ids[:concurrency], params, mode, None, branches)


def timed_runs(target: LoadedModel, drafter: DFlashDrafter | None, ids: list[list[int]], params: GenerationParams,
               repeat: int, engine_modes: Sequence[str], log: Path | None, concurrency: int = 1,
               branches: int = 1) -> dict[str, list[list[Any]]]:
    """Each mode's results, per repeat and prompt (engine modes: per group of ``concurrency``
    prompts). Every group goes through all the modes back to back before the next starts: a
    slow phase of the machine (host timings on the GPU machine drift by tens of percent within
    seconds) then falls on every mode alike. Plain decoding and the reference loop take a
    group's prompts one at a time."""
    modes = ["plain"] + (["reference"] if drafter is not None else []) + (list(engine_modes) if drafter is not None else [])
    runs: dict[str, list[list[Any]]] = {mode: [[] for _ in range(repeat)] for mode in modes}
    groups = [ids[i : i + concurrency] for i in range(0, len(ids), concurrency)]
    # on a terminal: a bar over (repeat, group, mode) runs; minutes pass between its steps' ends otherwise unseen
    with tqdm(total=repeat * len(groups) * len(modes), desc="bench", unit="run", disable=None, leave=False) as bar:
        for r in range(repeat):
            for group in groups:
                runs["plain"][r] += [run_plain(target, prompt, params) for prompt in group]
                bar.update()
                if drafter is None:
                    continue
                runs["reference"][r] += [run_dflash(target, drafter, prompt, params, branches) for prompt in group]
                bar.update()
                for mode in engine_modes:
                    runs[mode][r].append(anyio.run(run_together, target, drafter, group, params, mode, log, branches))
                    bar.update()
    return runs


def pooled(runs: list[list[Any]]) -> list[Any]:
    return [result for run in runs for result in run]


def dflash_report(drafter: DFlashDrafter, params: GenerationParams, runs: dict[str, list[list[Any]]],
                  want: list[list[int]], names: list[str]) -> dict[str, Any]:
    """Tokens/s of each mode over all its runs (and per run), tau, round costs and exactness."""
    reference = runs.pop("reference")
    outputs = {"reference": [[r.token_ids for r, _ in run] for run in reference],
               **{mode: [[t for g in run for t, _ in g.results] for run in done] for mode, done in runs.items()}}
    # a prompt counts as equal when every repeat of the mode gave plain greedy's output; in
    # half precision a block verify and one-token forwards round differently, so near-ties
    # may flip: how many outputs still equal plain greedy says how often
    equal = {mode: sum(all(run[i] == w for run in got) for i, w in enumerate(want)) for mode, got in outputs.items()}
    exact = {mode: n == len(want) for mode, n in equal.items()}
    # where each output first leaves plain greedy's (first run): a near-tie flipped there, and
    # everything after it follows from a different prefix
    divergence = {mode: divergence_summary([first_divergence(w, got[0][i]) for i, w in enumerate(want)])
                  for mode, got in outputs.items()}
    block = block_size_for(drafter, params)
    merged = SpeculativeStats([r for _, s in pooled(reference) for r in s.rounds])
    ref = {**aggregate([r for r, _ in pooled(reference)]), **merged.summary(block),
           "round_parts_ms": round_costs_ms([s for _, s in pooled(reference)]),
           # which prompts draft worst is what a drafter's next training data should cover
           "tau_per_prompt": [{"name": name, "tau": round(float(s.summary(block)["tau"]), 3)}
                              for name, (_, s) in zip(names, reference[0])],
           "runs_tokens_per_s": [aggregate([r for r, _ in run])["tokens_per_s"] for run in reference]}
    report = {"block_size": block, "reference": ref, "exact": all(exact.values()), "exact_per_mode": exact,
              "equal_outputs_per_mode": equal, "first_divergence_per_mode": divergence}
    if runs:
        modes = {mode: {**engine_summary(pooled(done)), "runs_tokens_per_s": [engine_summary(r)["tokens_per_s"] for r in done]}
                 for mode, done in runs.items()}
        report.update({mode: row for mode, row in modes.items() if mode != "pipelined"})
        if "pipelined" in modes:
            report["dflash"] = {**modes["pipelined"], "acceptance_per_position": ref["acceptance_per_position"]}
        if "sequential" in modes:
            sequential = modes["sequential"]["tokens_per_s"] or 1.0
            report.update({f"{mode.replace('-', '_')}_over_sequential": round(modes[mode]["tokens_per_s"] / sequential, 3)
                           for mode in modes if mode != "sequential"})
    return report


def print_table(report: dict[str, Any]) -> None:
    print(f"device {report['device']} ({report['dtype']}{', quantized' if report['quantized'] else ''}), "
          f"{report['prompts']} prompts, max_tokens {report['max_tokens']}, block {report.get('block_size', '-')}, "
          f"engine concurrency {report['concurrency']}, branches {report.get('branches', 1)}, "
          f"load {report.get('load_s', 0):.1f} s")
    if "split" in report:
        print(f"prompts {report['prompt_set']}: {report['split']} split (docs/evaluation.md)")
    if report.get("oracle_tau") is not None:
        print(f"ORACLE acceptance (a measuring instrument, runtime.oracle): drafts fixed to reach tau {report['oracle_tau']:g}")
    print(f"{'mode':<11} {'tok/s':>9} {'speedup':>8} {'ttft ms':>9} {'tau':>6} {'round ms':>9} {'idle ms/rd':>10} {'= plain':>7}")
    plain_speed = report["plain"]["tokens_per_s"] or 1.0
    names = [("plain", "plain"), ("reference", "reference")] + [(m, "dflash" if m == "pipelined" else m) for m in MODES]
    for name, key in names:
        if key not in report:
            continue
        row = report[key]
        equal = report.get("equal_outputs_per_mode", {}).get(name)
        exact = f"{equal}/{report['prompts']}" if equal is not None else ""
        print(f"{name:<11} {row['tokens_per_s']:>9.2f} {row['tokens_per_s'] / plain_speed:>8.2f} {row['ttft_ms']:>9.1f} "
              f"{row.get('tau', 1.0):>6.2f} {row.get('round_ms', 0.0):>9.2f} {row.get('gpu_idle_ms_per_round', 0.0):>10.3f} {exact:>7}")
    if "reference" in report:
        print("acceptance per block position:", " ".join(f"{x:.2f}" for x in report["reference"]["acceptance_per_position"]))
        print("reference round parts (ms):", ", ".join(f"{k[:-2]} {v}" for k, v in report["reference"]["round_parts_ms"].items()))
        for mode, row in report["first_divergence_per_mode"].items():
            if row["median"] is not None:
                shown = ", ".join("-" if p is None else str(p) for p in row["positions"])
                print(f"first token off plain greedy ({mode}): median {row['median']}; per prompt {shown}")


def oracle_drafter(target: LoadedModel, spec: str, tau: float, block_size: int) -> OracleDrafter:
    """A random:L drafter whose rounds accept tau - 1 drafts on average, on a random target."""
    layers, dflash2 = parse_random_spec(spec)
    drafter = random_drafter(target, layers, dflash2, block_size=block_size, drafter_class=OracleDrafter)
    return drafter.aim(greedy_successor(target.config), tau)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser("python -m runtime.bench", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--draft", help="drafter folder, or random:L (default: the bundled drafter; 'none': plain only)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with 'prompt' or 'messages' per line")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--log", type=Path, help="append the engine runs' round logs (JSON lines) to this file")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every mode this many times over the prompts; each reports all its runs pooled, and each run")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="the engine modes run this many prompts at once (their rounds batched into shared forwards); "
                             "plain and reference stay one at a time")
    parser.add_argument("--oracle-tau", type=float, default=None,
                        help="a measuring instrument, never a default: on a random:NAME target, every round accepts a "
                             "fixed number of drafts (tau - 1 on average) from a random:L drafter (runtime.oracle)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES), metavar="MODE",
                        help=f"the engine modes to run (default all: {' '.join(MODES)})")
    parser.add_argument("--branches", type=int, choices=range(1, MAX_BRANCHES + 1), default=1, metavar="K",
                        help="blocks every round drafts and verifies, keeping the one accepted furthest (runtime/branches.py)")
    parser.add_argument("--no-engine", action="store_true",
                        help="plain decoding and the reference loop only: tau and exactness, without the actor engine's modes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.prompts.is_file():  # before minutes of loading
        raise RequestError("prompts", f"{args.prompts} does not exist")
    started = time.perf_counter()
    target = load_target(args.model or default_model_path(), dtype=args.dtype)
    load_s = time.perf_counter() - started
    if args.oracle_tau is not None:
        drafter = oracle_drafter(target, args.draft or "random:5", args.oracle_tau, args.block_size or 16)
    else:
        drafter = None if args.draft == "none" else resolve_drafter(args.draft, target, block_size=args.block_size or 16)
    params = GenerationParams(max_tokens=args.max_tokens, block_size=args.block_size)
    report = {"load_s": round(load_s, 2), "oracle_tau": args.oracle_tau, "prompt_set": str(args.prompts),
              "split": split_of(args.prompts), **bench(target, drafter, read_prompts(args.prompts, target), params, args.log,
                                                   not args.no_engine, args.repeat, args.concurrency, args.modes,
                                                   args.branches)}
    print_json(report) if args.json else print_table(report)


if __name__ == "__main__":
    run_cli(main)
