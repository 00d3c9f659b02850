"""``python -m runtime.profile``: where a DFlash round's time goes on this device.

    python -m runtime.profile [--draft random:5] [--block-size 16] [--context 256] [--reps 20]

For the verify forward (``[anchor] + drafts`` through the target, device-side KV length,
as the verifier runs it), the draft forward (the drafter over its device cache and, for a
DFlash 1 drafter, the block copied from the text, as the drafter actor runs them), a whole
round (draft then verify of its drafts) and a one-token target forward (plain decoding), it
reports:

- ``ops``: primitives in the step's graph (each one is a kernel launch or a view), and
  ``top_ops`` the most frequent of them by name;
- ``first_ms``: the first call, synced (includes kernel builds for new shapes);
- ``synced_ms``: build, queue and wait, per call (what a sequential loop pays);
- ``build_ms``: building the graph alone, per call (Python and op construction);
- ``host_ms``: build and queue alone, per call (what the host pays while the device runs);
- ``queued_ms``: per call with ``reps`` calls queued before one wait (device throughput:
  when it is close to ``host_ms`` the step is bound by the host, not the device).

Every repetition starts from the same cache state, so all run at the same shapes; the
``verify_chain_*`` rows instead run verifies one after another on the live caches: each
waited for (as sequential rounds are), the previous one read while the next is queued (as
pipelined rounds are), the one two back (as a second round of lookahead would), or all
queued, to show what waits and buffers still in flight cost. Then
the actor engine runs one request in each mode under cProfile, and the functions with
the most own time are listed: the host's share of a round, by function. ``--compile both``
(the default) measures everything with eager and with compiled steps (runtime.models.steps).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import re
import time
from collections import Counter
from typing import Any, Callable, Sequence

import anyio
import mlx.core as mx
from tqdm import tqdm

from protocol import GenerationParams

from .bench import run_engine
from .cache import DeviceKVCache, advance_layers
from .cli import add_model_arguments, new_parser, print_json, run_cli
from .defaults import default_model_path
from .drafters import resolve_drafter
from .engine import MODES
from .loading import LoadedModel, load_target
from .lookup import TokenHistory
from .models.dflash import DFlashDrafter
from .models.steps import default_compile_steps

Step = Callable[[], Sequence[mx.array]]
TOP_OPS = 40


def op_counts(outputs: Sequence[mx.array]) -> Counter[str]:
    """Primitives in the lazy graph of ``outputs``, by name (read from MLX's dot export)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot.getvalue()))


def time_step(step: Step, caches: Sequence[DeviceKVCache], reps: int) -> dict[str, float]:
    """The step's costs; its caches are restored after every call, so shapes never change."""
    saved = [c.snapshot() for c in caches]

    def call() -> Sequence[mx.array]:
        outputs = step()
        for cache, state in zip(caches, saved):
            cache.restore(state)
        return outputs

    ops = op_counts(call())
    start = time.perf_counter()
    mx.eval(*call())
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(*call())
    synced = (time.perf_counter() - start) / reps
    host, queued = queue_calls(call, reps)
    return {"ops": sum(ops.values()), "top_ops": dict(ops.most_common(TOP_OPS)), "first_ms": _ms(first),
            "synced_ms": _ms(synced), "build_ms": _ms(build_time(call, reps)), "host_ms": _ms(host), "queued_ms": _ms(queued)}


def build_time(call: Step, reps: int) -> float:
    """Seconds per call to build the graph alone (Python and op construction; the rest of
    ``host_ms`` is MLX encoding and launching it, which releases the GIL)."""
    total = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        outputs = call()
        total += time.perf_counter() - start
        mx.eval(*outputs)
    return total / reps


def queue_calls(call: Step, reps: int, lag: int | None = None,
                after: Callable[[int], None] = lambda i: None) -> tuple[float, float]:
    """``reps`` calls, each queued with ``mx.async_eval`` and then ``after(i)``. With ``lag`` k, once
    call i is queued the host reads call i-k's outputs (k=0: waits for each call, as sequential
    rounds do; k=1: reads the previous one while this one is queued, as pipelined rounds do);
    without, all are waited for at the end. Seconds per call: building and queueing it, and in all."""
    host, pending = 0.0, []
    start = time.perf_counter()
    for i in range(reps):
        t = time.perf_counter()
        outputs = call()
        mx.async_eval(*outputs)
        host += time.perf_counter() - t
        after(i)
        pending.append(outputs)
        if lag is not None and i >= lag:
            mx.eval(*pending[i - lag])
    mx.eval(*[o for outputs in pending for o in outputs])
    return host / reps, (time.perf_counter() - start) / reps


def _ms(seconds: float) -> float:
    return round(1e3 * seconds, 3)


def prompt_ids(target: LoadedModel, length: int) -> list[int]:
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    ids = target.tokenizer.encode(text * (length // 8 + 1), add_special_tokens=False)
    return ids[:length]


def round_parts(target: LoadedModel, drafter: DFlashDrafter, context: int, block: int, reps: int) -> dict[str, Any]:
    """Each step of a round at ``context`` tokens, built as the actors build it."""
    model = target.model
    ids = prompt_ids(target, context)
    target_cache, drafter_cache = model.make_device_cache(), drafter.make_device_cache()
    out = model(mx.array([ids]), target_cache, tap_layers=drafter.tap_layers, logits_row=len(ids) - 1)
    n = mx.array(len(ids), dtype=mx.int32)
    advance_layers(target_cache, n)
    drafter.write_context(out.taps, drafter_cache, n)
    mx.eval(out.logits, out.taps, *[c.keys for c in target_cache + drafter_cache])
    for layer in target_cache + drafter_cache:
        layer.settle(len(ids))
    # room for every timed step first: a buffer growing inside a step (or a chain) would time
    # the growth and, with compiled steps, the new trace for its size, not the step
    for layer in target_cache:
        layer.reserve(block + reps)
    for layer in drafter_cache:
        layer.reserve(2 * block)
    mx.eval(*[c.keys for c in target_cache + drafter_cache], *[c.values for c in target_cache + drafter_cache])
    anchor = mx.argmax(out.logits[0, -1]).astype(mx.int32).reshape(1)
    taps = out.taps[:, -block:]  # a round's worth of new context rows, all kept
    keep = mx.array(block, dtype=mx.int32)
    mask_ids = mx.full((block - 1,), drafter.args.mask_token_id, dtype=mx.int32)
    history = TokenHistory.for_request(ids, reps, block)

    def draft() -> Sequence[mx.array]:
        hidden = drafter.hidden(mx.concatenate([anchor, mask_ids])[None], taps, drafter_cache, keep=keep)
        # a DFlash 1 drafter's block may be the one copied from the text (runtime/lookup.py)
        copied = history.drafts(block - 1) if drafter.copies_blocks else None
        return [drafter.propose(hidden[:, 1:], anchor, context=copied).tokens[:, 0]]  # DFlash 2: the selector's greedy path

    def verify(drafts: mx.array) -> Sequence[mx.array]:
        result = model(mx.concatenate([anchor, drafts.reshape(-1)])[None], target_cache, tap_layers=drafter.tap_layers)
        advance_layers(target_cache, 1)
        assert result.taps is not None
        return [mx.argmax(result.logits, axis=-1), result.taps, target_cache[0].length]

    drafts = draft()[0]
    mx.eval(drafts)
    # plain decoding's own step (runtime.plain): one token over device caches, compiled where steps are
    plain_cache = model.make_device_cache()
    mx.eval(model.prefill(ids, plain_cache).logits)
    for layer in plain_cache:
        layer.reserve(reps + 1)

    def plain() -> Sequence[mx.array]:
        logits = model(anchor[None], plain_cache).logits
        advance_layers(plain_cache, 1)
        return [mx.argmax(logits[0, -1]), plain_cache[0].length]

    mx.eval(*plain())  # a first trace and any buffer growth now, not in a timed call

    both = target_cache + drafter_cache
    return {
        "verify": time_step(lambda: verify(drafts), target_cache, reps),
        "draft": time_step(draft, drafter_cache, reps),
        "round": time_step(lambda: verify(draft()[0]), both, reps),
        "plain_token": time_step(plain, plain_cache, reps),
        "verify_chain_waited": chained(lambda: verify(drafts), target_cache, len(ids), reps, lag=0),
        "verify_chain_read_previous": chained(lambda: verify(drafts), target_cache, len(ids), reps, lag=1),
        "verify_chain_read_two_back": chained(lambda: verify(drafts), target_cache, len(ids), reps, lag=2),
        "verify_chain_queued": chained(lambda: verify(drafts), target_cache, len(ids), reps, lag=None),
    }


def chained(step: Step, caches: Sequence[DeviceKVCache], length: int, reps: int, lag: int | None) -> dict[str, float]:
    """Steps one after another on the live caches, each keeping one row, read as ``queue_calls``'s
    ``lag`` says: each waited for (sequential rounds), the previous one read while the next is
    queued (pipelined rounds), or none until the end.

    A buffer that a step still in flight holds cannot be updated in place, so MLX copies it:
    if the queued chain costs the host more per step than the waited one, that is why. If
    reading the previous step costs the host as much as waiting for each, the reads do.
    """
    saved = [c.snapshot() for c in caches]

    def settle(i: int) -> None:  # each step kept one row: the host knows the length without reading it
        for cache in caches:
            cache.settle(length + i + 1)

    host, per_step = queue_calls(step, reps, lag, settle)
    for cache, state in zip(caches, saved):
        cache.restore(state)
    return {"host_ms": _ms(host), "per_step_ms": _ms(per_step)}


def engine_profile(target: LoadedModel, drafter: DFlashDrafter, max_tokens: int, block: int, top: int,
                   done: Callable[[], Any] = lambda: None, branches: int = 1) -> dict[str, Any]:
    """One request per mode under cProfile (after a warm-up run), its rounds verifying ``branches``
    blocks (runtime/branches.py): tokens/s and the top functions; ``done()`` after each mode."""
    ids = prompt_ids(target, 64)
    params = GenerationParams(max_tokens=max_tokens, block_size=block)
    report = {}
    for mode in MODES:
        anyio.run(run_engine, target, drafter, [ids], params, mode, None, branches)
        profiler = cProfile.Profile()
        profiler.enable()
        ((_, event),) = anyio.run(run_engine, target, drafter, [ids], params, mode, None, branches)
        profiler.disable()
        rows = pstats.Stats(profiler).sort_stats("tottime")
        stats: Any = rows.stats  # type: ignore[attr-defined]
        listed = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        rounds = int(event.stats["rounds"])  # type: ignore[arg-type]
        report[mode] = {
            "tokens_per_s": round(event.timings["tokens_per_s"], 2), "rounds": rounds,
            "top_ms_per_round": [(f"{fn[0].split('/')[-1]}:{fn[1]}:{fn[2]}", round(1e3 * v[2] / rounds, 3), v[1])
                                 for fn, v in listed],
        }
        done()
    return report


def main(argv: list[str] | None = None) -> None:
    parser = new_parser("python -m runtime.profile", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--draft", default="random:5",
                        help="drafter folder, random:L or random:L:dflash2 (a DFlash 2 one) (default random:5)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context", type=int, default=256, help="tokens already in the caches")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=128, help="per request in the engine profile")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--no-engine", action="store_true", help="skip the engine profile")
    parser.add_argument("--branches", type=int, default=1, metavar="K",
                        help="blocks each of the engine profile's rounds verifies (runtime/branches.py)")
    parser.add_argument("--compile", choices=["auto", "on", "off", "both"], default="both",
                        help="compiled verify/draft steps (auto: on a GPU only); both: each in turn")
    args = parser.parse_args(argv)
    target = load_target(args.model or default_model_path(), dtype=args.dtype)
    drafter = resolve_drafter(args.draft, target, block_size=args.block_size)
    report: dict[str, Any] = {"device": str(mx.default_device()), "dtype": target.compute_dtype}
    settings = {"auto": [default_compile_steps()], "on": [True], "off": [False], "both": [False, True]}[args.compile]
    steps = len(settings) * (1 + (0 if args.no_engine else len(MODES)))
    # on a terminal: a bar over the parts and engine modes of each setting (minutes on a fresh GPU)
    with tqdm(total=steps, desc="profile", unit="step", disable=None, leave=False) as bar:
        for compiled in settings:
            target.model.compile_steps = drafter.compile_steps = compiled
            run: dict[str, Any] = {"parts": round_parts(target, drafter, args.context, args.block_size, args.reps)}
            bar.update()
            if not args.no_engine:
                run["engine"] = engine_profile(target, drafter, args.max_tokens, args.block_size, args.top, bar.update,
                                               args.branches)
            report["compiled" if compiled else "eager"] = run
    print_json(report)


if __name__ == "__main__":
    run_cli(main)
