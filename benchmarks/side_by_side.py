"""Ours against mlx-lm at the sizes people run DFlash on, in one run (random targets of published shapes).

    PYTHONPATH=. python benchmarks/side_by_side.py [--models random:qwen3-8b random:qwen3-8b-4bit ...]
        [--taus 2 4 6.5 8] [--max-tokens 256] [--prompts 5] [--concurrency 8 32] [--concurrent-taus 4 6.5] [--json OUT]

Our target runs as it loads (with the batch-invariant kernel where it applies on a GPU:
``DFLASH_BATCH_INVARIANT``, runtime.models.batch_invariant); mlx-lm's twin keeps MLX's matmuls.

For each model (``runtime.random_targets``: the published config, random weights whose greedy
decoding follows a known permutation):
- plain decoding, ours (``runtime.plain``) and mlx-lm's ``stream_generate``, over the same
  arrays (mlx-lm's modules are given ours: no copy, so the same weights to the bit), one prompt
  at a time, tokens/s after the first token, each side's best of ``--plain-passes`` passes taken
  in turn (one pass each moved mlx-lm's figure by up to 40% between calls);
- ours with the oracle drafter (``runtime.oracle``, a measuring instrument: every round accepts
  a fixed number of drafts) at each tau, through the pipelined engine, and the sequential
  reference loop for a round's parts (draft, verify, host ms); a round's cost in plain tokens
  (ours) is ``tau * plain tok/s / dflash tok/s``;
- at each concurrency, our engine's batched rounds (oracle at each tau) against mlx-lm's
  ``batch_generate``: aggregate tokens/s;
- memory: resident after loading (both models' weights, ours fused) and each phase's peak.
Every output is checked against plain greedy (ours and mlx-lm's must agree too).
Needs mlx-lm (not a dependency of the runtime): ``pip install mlx-lm``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import anyio
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from protocol import GenerationParams
from runtime.bench import (
    DEFAULT_PROMPTS,
    aggregate,
    engine_summary,
    oracle_drafter,
    read_prompts,
    round_costs_ms,
    run_dflash,
    run_plain,
    run_together,
)
from runtime.loading import LoadedModel, load_checkpoint
from runtime.oracle import OracleDrafter
from runtime.random_targets import random_checkpoint

GB = 1 << 30


def mlx_lm_twin(target: LoadedModel) -> tuple[nn.Module, Any]:
    """mlx-lm's model over our (unfused) arrays, and a tokenizer wrapper without EOS."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from mlx_lm.utils import _get_classes
    from transformers import PreTrainedTokenizerFast

    model_class, args_class = _get_classes(config=target.config)
    model = model_class(args_class.from_dict(target.config))
    weights = dict(tree_flatten(target.model.parameters()))
    if target.quantized:
        q = target.config["quantization"]
        nn.quantize(model, group_size=q["group_size"], bits=q["bits"], class_predicate=lambda p, _m: f"{p}.scales" in weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    return model, TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=target.tokenizer._backend))


def mlx_lm_plain(model: nn.Module, tokenizer: Any, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """stream_generate: tokens, time to first token, decode seconds after it."""
    from mlx_lm import stream_generate

    start = time.perf_counter()
    tokens, first = [], 0.0
    for response in stream_generate(model, tokenizer, mx.array(ids), max_tokens=max_tokens):
        if not tokens:
            first = time.perf_counter()
        tokens.append(int(response.token))
    return tokens, first - start, time.perf_counter() - first


def peak_gb(run: Callable[[], Any]) -> tuple[Any, float]:
    mx.reset_peak_memory()
    out = run()
    return out, round(mx.get_peak_memory() / GB, 2)


def mlx_lm_tokens_per_s(runs: list[tuple[list[int], float, float]]) -> float:
    return round(sum(len(t) - 1 for t, _, _ in runs) / sum(d for _, _, d in runs), 2)


def plain_rows(target: LoadedModel, twin: tuple[nn.Module, Any], prompts: list[list[int]], params: GenerationParams,
               rounds: int) -> dict[str, Any]:
    """Each side's best of ``rounds`` passes over the prompts, ours and mlx-lm's taking turns: the
    host's speed drifts by tens of percent between passes, and turns share the drift."""
    ours_passes, theirs_passes = [], []
    for _ in range(rounds):
        ours_passes.append(peak_gb(lambda: [run_plain(target, ids, params) for ids in prompts]))
        theirs_passes.append(peak_gb(lambda: [mlx_lm_plain(*twin, ids, params.max_tokens) for ids in prompts]))
    ours, ours_peak = max(ours_passes, key=lambda p: aggregate(p[0])["tokens_per_s"])
    theirs, theirs_peak = max(theirs_passes, key=lambda p: mlx_lm_tokens_per_s(p[0]))
    mlx_lm_tps = mlx_lm_tokens_per_s(theirs)
    return {
        "ours": {**aggregate(ours), "peak_gb": ours_peak,
                 "passes_tokens_per_s": [aggregate(p)["tokens_per_s"] for p, _ in ours_passes]},
        "mlx_lm": {"tokens_per_s": mlx_lm_tps, "ttft_ms": round(1e3 * statistics.mean(f for _, f, _ in theirs), 2),
                   "peak_gb": theirs_peak, "passes_tokens_per_s": [mlx_lm_tokens_per_s(p) for p, _ in theirs_passes]},
        "ours_over_mlx_lm": round(aggregate(ours)["tokens_per_s"] / mlx_lm_tps, 3),
        "outputs_agree": [r.token_ids for r in ours] == [t for t, _, _ in theirs],
        "greedy": [r.token_ids for r in ours],
    }


def dflash_row(target: LoadedModel, drafter: OracleDrafter, prompts: list[list[int]], params: GenerationParams,
               want: list[list[int]], plain_tps: float, mlx_lm_tps: float) -> dict[str, Any]:
    groups, peak = peak_gb(lambda: [anyio.run(run_together, target, drafter, [ids], params, "pipelined") for ids in prompts])
    reference = [run_dflash(target, drafter, ids, params) for ids in prompts]
    summary = engine_summary(groups)
    tps = summary["tokens_per_s"]
    return {
        "oracle_tau": drafter.tau, "tau": summary["tau"], "tokens_per_s": tps, "peak_gb": peak,
        "over_ours_plain": round(tps / plain_tps, 3), "over_mlx_lm_plain": round(tps / mlx_lm_tps, 3),
        "round_cost_plain_tokens": round(summary["tau"] * plain_tps / tps, 3) if tps else None,
        "round_ms": summary["round_ms"], "gpu_idle_ms_per_round": summary["gpu_idle_ms_per_round"],
        "reference_round_parts_ms": round_costs_ms([s for _, s in reference]),
        "reference_tokens_per_s": aggregate([r for r, _ in reference])["tokens_per_s"],
        "equal_to_plain": sum(t == w for (t, _), w in zip([r for g in groups for r in g.results], want)),
    }


def concurrent_rows(target: LoadedModel, twin: tuple[nn.Module, Any], drafters: list[OracleDrafter],
                    prompts: list[list[int]], params: GenerationParams, plain_tps: float) -> dict[str, Any]:
    from mlx_lm import batch_generate

    batch = batch_generate(*twin, prompts, max_tokens=params.max_tokens)
    row: dict[str, Any] = {"mlx_lm_batch": {"tokens_per_s": round(batch.stats.generation_tps, 2),
                                            "peak_gb": round(batch.stats.peak_memory, 2)}}
    for drafter in drafters:
        anyio.run(run_together, target, drafter, prompts, params, "pipelined")  # this batch size's compiled steps
        group, peak = peak_gb(lambda d=drafter: anyio.run(run_together, target, d, prompts, params, "pipelined"))
        summary = engine_summary([group])
        row[f"oracle_tau_{drafter.tau:g}"] = {
            "tokens_per_s": summary["tokens_per_s"], "tau": summary["tau"], "mean_batch_size": summary["mean_batch_size"],
            "over_mlx_lm_batch": round(summary["tokens_per_s"] / row["mlx_lm_batch"]["tokens_per_s"], 3),
            "over_one_plain_stream": round(summary["tokens_per_s"] / plain_tps, 3), "peak_gb": peak}
    return row


def measure(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    target = load_checkpoint(random_checkpoint(spec, overrides=args.override), dtype=args.dtype, fuse=False)
    twin = mlx_lm_twin(target)
    target.model.fuse_projections()
    kernel = target.model.use_batch_invariant_projections()
    mx.eval(twin[0].parameters())
    report: dict[str, Any] = {"model": spec, "dtype": target.compute_dtype, "quantized": target.quantized,
                              "load_s": round(time.perf_counter() - started, 1), "resident_gb": round(mx.get_active_memory() / GB, 2),
                              "batch_invariant": kernel}
    params = GenerationParams(max_tokens=args.max_tokens)
    prompts = [ids for _, ids in read_prompts(DEFAULT_PROMPTS, target)][: args.prompts]
    drafters = [oracle_drafter(target, f"random:{args.layers}", tau, args.block_size) for tau in args.taus]
    warm = GenerationParams(max_tokens=24)
    run_plain(target, prompts[0], warm)
    mlx_lm_plain(*twin, prompts[0], 24)
    for drafter in drafters:  # every buffer size the timed runs reach, for each tau's round shapes
        anyio.run(run_together, target, drafter, [min(prompts, key=len), max(prompts, key=len)], params, "pipelined")
        run_dflash(target, drafter, prompts[0], warm)
    plain = plain_rows(target, twin, prompts, params, args.plain_passes)
    want = plain.pop("greedy")
    report["plain"] = plain
    plain_tps, mlx_lm_tps = plain["ours"]["tokens_per_s"], plain["mlx_lm"]["tokens_per_s"]
    report["dflash"] = [dflash_row(target, d, prompts, params, want, plain_tps, mlx_lm_tps) for d in drafters]
    report["concurrent"] = {}
    for n in args.concurrency:
        group = (prompts * n)[:n]
        chosen = [d for d in drafters if d.tau in args.concurrent_taus]
        report["concurrent"][str(n)] = concurrent_rows(target, twin, chosen, group, params, plain_tps)
    print_model(report)
    return report


def print_model(r: dict[str, Any]) -> None:
    p = r["plain"]
    print(f"\n{r['model']} ({r['dtype']}{', quantized' if r['quantized'] else ''}): resident {r['resident_gb']} GB, "
          f"load {r['load_s']} s, batch-invariant kernel {r['batch_invariant']}")
    print(f"plain tok/s, best of {len(p['ours']['passes_tokens_per_s'])} passes each: ours {p['ours']['tokens_per_s']} "
          f"{p['ours']['passes_tokens_per_s']}, mlx-lm {p['mlx_lm']['tokens_per_s']} {p['mlx_lm']['passes_tokens_per_s']} "
          f"(ours/mlx-lm {p['ours_over_mlx_lm']}; outputs agree: {p['outputs_agree']}); peak GB {p['ours']['peak_gb']} / {p['mlx_lm']['peak_gb']}")
    print(f"{'oracle tau':>10} {'tau':>6} {'tok/s':>9} {'x ours':>7} {'x mlx-lm':>9} {'round/plain tok':>15} {'round ms':>9} {'idle ms':>8} "
          f"{'ref parts ms (draft/verify/host)':>32} {'= plain':>7}")
    for d in r["dflash"]:
        parts = d["reference_round_parts_ms"]
        print(f"{d['oracle_tau']:>10g} {d['tau']:>6.2f} {d['tokens_per_s']:>9.1f} {d['over_ours_plain']:>7.2f} {d['over_mlx_lm_plain']:>9.2f} "
              f"{d['round_cost_plain_tokens']:>15.3f} {d['round_ms']:>9.2f} {d['gpu_idle_ms_per_round']:>8.3f} "
              f"{'/'.join(str(parts.get(k, '-')) for k in ('draft_s', 'verify_s', 'host_s')):>32} {d['equal_to_plain']:>7}")
    for n, row in r["concurrent"].items():
        ours = ", ".join(f"tau {k.split('_')[-1]}: {v['tokens_per_s']} ({v['over_mlx_lm_batch']}x, batch {v['mean_batch_size']})"
                         for k, v in row.items() if k.startswith("oracle"))
        print(f"{n} at once: mlx-lm batch_generate {row['mlx_lm_batch']['tokens_per_s']} tok/s; ours {ours}")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["random:qwen3-8b", "random:qwen3-8b-4bit", "random:llama-3.1-8b",
                                                        "random:llama-3.1-8b-4bit", "random:qwen3-4b", "random:qwen3-4b-4bit"])
    parser.add_argument("--taus", nargs="+", type=float, default=[2, 4, 6.5, 8])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=5, help="drafter layers (z-lab's drafters for these targets have 5)")
    parser.add_argument("--concurrency", nargs="*", type=int, default=[8, 32])
    parser.add_argument("--concurrent-taus", nargs="*", type=float, default=[4, 6.5], help="the oracle taus run at each concurrency")
    parser.add_argument("--plain-passes", type=int, default=2,
                        help="plain decoding passes over the prompts, ours and mlx-lm's in turn; each side's best is reported")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dtype", default="native", help="native: bf16 activations, as published and as mlx-community ships")
    parser.add_argument("--override", type=json.loads, default=None,
                        help="config fields to override, as JSON: smaller shapes for a quick check on a CPU")
    args = parser.parse_args()
    print(f"device {mx.default_device()}, mlx {mx.__version__}; oracle acceptance is a measuring instrument "
          "(runtime.oracle): each round accepts a fixed number of drafts", flush=True)
    reports = []
    for spec in args.models:
        reports.append(measure(spec, args))
        mx.clear_cache()
        if args.json:
            args.json.write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
