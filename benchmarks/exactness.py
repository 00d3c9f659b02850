"""Where a block verify and a one-token step compute differently (half-precision exactness, issue #25).

    PYTHONPATH=. python benchmarks/exactness.py --dtype bfloat16 --prompts runs/eval/test/math.jsonl [--max-tokens 256]

Prints, as JSON lines:
1. ``matmul``: for each projection shape of the model, the fraction of output elements whose
   row ``i`` of an ``M``-row product differs from the same row computed alone (M = 2..16):
   the verify multiplies 16 rows at once, plain decoding one.
2. ``attention``: one query over a cache, alone (plain decoding's path) against the same query
   as row ``k`` of a 16-query causal block, for the kernel and for masked sdpa.
3. ``trace``: at each prompt's first divergent token, every recorded op of every layer for that
   position, computed as a 1-token step and as row ``k`` of a 16-token block over the same
   cache: the first op whose output differs (its input did not).
4. ``agreement``: per prompt, the first position where the engine's output leaves plain
   greedy's (None: equal). Run it again with ``DFLASH_ATTENTION=sdpa`` (or another setting)
   in the environment to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import mlx.nn as nn

from protocol import GenerationParams
from runtime.bench import (
    divergence_summary,
    first_divergence,
    read_prompts,
    run_plain,
    run_together,
)
from runtime.cache import advance_layers, round_up
from runtime.defaults import default_drafter_path, default_model_path
from runtime.loading import LoadedModel, load_drafter, load_target
from runtime.models.attention import cache_attention
from runtime.models.decoder import PREFILL_BUCKET


def say(kind: str, **fields: Any) -> None:
    print(json.dumps({"kind": kind, **fields}), flush=True)


def time_us(step: Any, n: int = 200) -> float:
    """Device time per call of a chain of ``n`` (each waits on none: queued back to back)."""
    mx.eval(step())
    start = time.perf_counter()
    mx.eval([step() for _ in range(n)])
    return round(1e6 * (time.perf_counter() - start) / n, 2)


def matmul_rows(target: LoadedModel) -> None:
    layer = target.model.model.layers[0]
    projections = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
                   "down": layer.mlp.down_proj, "lm_head": target.model.logits}
    dtype = mx.bfloat16 if target.compute_dtype == "bfloat16" else mx.float16
    for name, proj in projections.items():
        inner = 1536 if name == "down" else target.model.args.hidden_size
        x = (mx.random.normal((16, inner)) * 0.5).astype(dtype)
        alone = mx.concatenate([proj(x[i : i + 1]) for i in range(16)], axis=0)
        row = {}
        for m in (2, 4, 8, 16):
            together = mx.concatenate([proj(x[i : i + m]) for i in range(0, 16, m)], axis=0)
            row[m] = round(float((together != alone).mean()), 5)
        as_batch = proj(x[:, None, :])[:, 0]  # 16 one-row products in one op: row-for-row what a 1-token step does?
        say("matmul", projection=name, differing_fraction_by_rows=row,
            one_row_batch_differing_fraction=round(float((as_batch != alone).mean()), 5),
            max_abs_16_rows=float(mx.abs(proj(x).astype(mx.float32) - alone.astype(mx.float32)).max()),
            us_16_rows=time_us(lambda: proj(x)), us_one_row_batch=time_us(lambda: proj(x[:, None, :])),
            us_one_row=time_us(lambda: proj(x[:1])))


def attention_rows(dtype: mx.Dtype) -> None:
    heads, kv_heads, d, length = 9, 3, 64, 300
    keys = (mx.random.normal((1, kv_heads, length + 16, d))).astype(dtype)
    values = (mx.random.normal((1, kv_heads, length + 16, d))).astype(dtype)
    q = (mx.random.normal((1, heads, 16, d))).astype(dtype)
    scale = d**-0.5
    start = mx.array([length], dtype=mx.int32)
    block = cache_attention(q, keys, values, start, causal=True, scale=scale)  # [1, 16, heads, d]
    mask = mx.arange(length + 16)[None, :] <= (length + mx.arange(16))[:, None]
    sdpa_block = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask).transpose(0, 2, 1, 3)
    for k in (0, 7, 15):
        n = length + k + 1
        kernel_one = cache_attention(q[:, :, k : k + 1], keys, values, mx.array([length + k], dtype=mx.int32),
                                     causal=True, scale=scale)
        vector_one = mx.fast.scaled_dot_product_attention(q[:, :, k : k + 1], keys[:, :, :n], values[:, :, :n],
                                                          scale=scale).transpose(0, 2, 1, 3)
        say("attention", query=k, kernel_block_vs_kernel_alone=float((block[:, k] != kernel_one[:, 0]).mean()),
            kernel_block_vs_sdpa_vector=float((block[:, k] != vector_one[:, 0]).mean()),
            sdpa_block_vs_sdpa_vector=float((sdpa_block[:, k] != vector_one[:, 0]).mean()),
            max_abs_kernel_vs_vector=float(mx.abs(block[:, k] - vector_one[:, 0]).max()))


class Recorder(nn.Module):
    """Wraps a module; logs its input and output rows."""

    def __init__(self, inner: Any, name: str, log: list[tuple[str, mx.array]]) -> None:
        super().__init__()
        self.inner, self.name, self.log = inner, name, log

    def __call__(self, x: mx.array, *args: Any) -> mx.array:
        out = self.inner(x, *args)
        self.log += [(self.name + ".in", x), (self.name, out)]
        return out


def recorded(target: LoadedModel, log: list[tuple[str, mx.array]]) -> list[tuple[Any, str, Any]]:
    """Put recorders around every projection and norm; returns what to put back."""
    swaps = []
    for i, layer in enumerate(target.model.model.layers):
        for owner, name in ((layer, "input_layernorm"), (layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                            (layer, "post_attention_layernorm"), (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")):
            swaps.append((owner, name, owner[name]))
            owner[name] = Recorder(owner[name], f"L{i}.{name}", log)
    return swaps


def trace_position(target: LoadedModel, tokens: list[int], position: int, device_cache: bool) -> dict[str, Any]:
    """The op-by-op comparison at ``position`` (a block of 16 starting at most 15 before it)."""
    model = target.model
    start = max(1, position - 8)
    k = position - start

    def run(prefix: int, block: list[int]) -> list[tuple[str, mx.array]]:
        cache = model.make_device_cache() if device_cache else model.make_cache()
        model(mx.array([tokens[:prefix]]), cache)
        for layer_cache in cache if device_cache else ():
            layer_cache.advance(prefix)  # a device cache keeps what its owner accepts
        log: list[tuple[str, mx.array]] = []
        swaps = recorded(target, log)
        compiled, model.compile_steps = model.compile_steps, False  # recorders must see real arrays, not a trace
        try:
            model(mx.array([block]), cache)
        finally:
            model.compile_steps = compiled
            for owner, name, inner in swaps:
                owner[name] = inner
        mx.eval([a for _, a in log])
        return log

    block_log = run(start, tokens[start : start + 16])
    step_log = run(position, tokens[position : position + 1])
    first = None
    worst: dict[str, float] = {}
    for (name, b), (_, s) in zip(block_log, step_log):
        row_b, row_s = b[0, k], s[0, 0]
        diff = float(mx.abs(row_b.astype(mx.float32) - row_s.astype(mx.float32)).max())
        if diff and first is None:
            first = name
        if not name.endswith(".in"):
            layer = name.split(".")[0]
            worst[layer] = max(worst.get(layer, 0.0), diff)
    return {"first_differing": first, "max_abs_diff_per_layer": worst}


def plain_on_device_cache(target: LoadedModel, ids: list[int], params: GenerationParams, bucket: int) -> list[int]:
    """Greedy one-token decoding over the engine's kind of cache: device lengths (RoPE at an array
    offset, the attention kernel), the prompt prefilled right-padded to ``bucket`` as the verifier does."""
    model = target.model
    cache = model.make_device_cache()
    n = len(ids)
    padded = ids + [ids[-1]] * (round_up(n, bucket) - n)
    logits = model(mx.array([padded]), cache, logits_row=n - 1).logits[:, -1]
    advance_layers(cache, n)
    for layer in cache:
        layer.settle(n)
    tokens = [int(mx.argmax(logits, axis=-1).item())]
    while len(tokens) < params.max_tokens and tokens[-1] not in target.tokenizer.eos_token_ids:
        logits = model(mx.array([[tokens[-1]]]), cache).logits[:, -1]
        advance_layers(cache, 1)
        for layer in cache:
            layer.settle(n + len(tokens))
        tokens.append(int(mx.argmax(logits, axis=-1).item()))
    return tokens


def divergences(target: LoadedModel, drafter: Any, prompts: list[tuple[str, list[int]]],
                params: GenerationParams) -> tuple[list[int | None], list[list[int]]]:
    results = [run_plain(target, ids, params) for _, ids in prompts]
    plain = [r.token_ids for r in results]
    alone = [anyio.run(run_together, target, drafter, [ids], params, "pipelined").results[0][0] for _, ids in prompts]
    say("plain_speed", tokens_per_s=round(sum(len(r.token_ids) - 1 for r in results) / sum(r.decode_s for r in results), 1))
    for bucket in (PREFILL_BUCKET, 1):
        on_device = [plain_on_device_cache(target, ids, params, bucket) for _, ids in prompts]
        positions = [first_divergence(want, got) for want, got in zip(on_device, alone)]
        say("agreement_with_plain_on_device_caches", prefill_bucket=bucket, equal=positions.count(None),
            prompts=len(positions), **divergence_summary(positions))
        positions = [first_divergence(want, got) for want, got in zip(plain, on_device)]
        say("plain_vs_plain_on_device_caches", prefill_bucket=bucket, equal=positions.count(None), **divergence_summary(positions))
    return [first_divergence(want, got) for want, got in zip(plain, alone)], plain


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=Path, nargs="+", required=True)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--traces", type=int, default=4, help="divergences to trace op by op")
    p.add_argument("--count", type=int, default=16, help="prompts taken from each file")
    p.add_argument("--agreement-only", action="store_true", help="skip the matmul and attention checks")
    args = p.parse_args()
    target = load_target(default_model_path(), dtype=args.dtype)
    drafter = load_drafter(default_drafter_path(), target)
    say("device", device=str(mx.default_device()), dtype=target.compute_dtype, quantized=target.quantized)
    if not args.agreement_only:
        matmul_rows(target)
    if mx.default_device() == mx.gpu and not args.agreement_only:  # the kernel is CUDA's
        attention_rows(mx.bfloat16 if target.compute_dtype == "bfloat16" else mx.float16)
    prompts = [item for path in args.prompts for item in read_prompts(path, target)[: args.count]]
    params = GenerationParams(max_tokens=args.max_tokens)
    positions, plain = divergences(target, drafter, prompts[:2], GenerationParams(max_tokens=24))  # warm-up
    positions, plain = divergences(target, drafter, prompts, params)
    say("agreement", settings={k: v for k, v in os.environ.items() if k.startswith("DFLASH_")}, equal=positions.count(None), prompts=len(positions),
        **divergence_summary(positions))
    traced = [(i, pos) for i, pos in enumerate(positions) if pos is not None][: args.traces]
    for i, pos in traced:
        tokens = prompts[i][1] + plain[i]
        absolute = len(prompts[i][1]) + pos
        for device_cache in (False, True):
            say("trace", prompt=prompts[i][0], position=pos, device_cache=device_cache,
                **trace_position(target, tokens, absolute, device_cache))


if __name__ == "__main__":
    sys.exit(main())
