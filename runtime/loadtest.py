"""Aggregate throughput of an OpenAI-compatible server at several concurrencies.

    python -m runtime.loadtest --url http://127.0.0.1:8000 --concurrency 1 2 4 8 16 32 \\
        --prompts prompts.jsonl --max-tokens 128 [--model NAME] [--json]

Each level runs ``concurrency`` clients at once, each sending ``--rounds`` chat
completions (greedy, not streamed) one after another over the prompts in turn; the
figure is all completion tokens (from ``usage``) over the level's wall time. Works
against this project's server and any other (mlx_lm.server, vLLM) on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from .bench import DEFAULT_PROMPTS
from .errors import RequestError
from .cli import new_parser, print_json, run_cli


def read_chat_prompts(path: Path) -> list[list[dict[str, str]]]:
    """JSONL lines with ``messages`` or ``prompt`` (sent as one user message)."""
    chats = []
    for line in path.read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            chats.append(item["messages"] if "messages" in item else [{"role": "user", "content": item["prompt"]}])
    return chats


async def one_level(client: httpx.AsyncClient, url: str, model: str, chats: list[list[dict[str, str]]],
                    concurrency: int, rounds: int, max_tokens: int) -> dict[str, Any]:
    tokens: list[int] = []
    latencies: list[float] = []
    errors: list[str] = []

    async def worker(index: int) -> None:
        for r in range(rounds):
            body = {"model": model, "messages": chats[(index * rounds + r) % len(chats)], "max_tokens": max_tokens,
                    "temperature": 0.0}
            started = time.perf_counter()
            try:
                response = await client.post(url + "/v1/chat/completions", json=body)
                response.raise_for_status()
            except httpx.HTTPError as exc:  # counted, not fatal: a server that drops connections shows it
                errors.append(type(exc).__name__)
                continue
            latencies.append(time.perf_counter() - started)
            tokens.append(int(response.json()["usage"]["completion_tokens"]))

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(concurrency):
            tg.start_soon(worker, i)
    wall = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": len(tokens), "completion_tokens": sum(tokens),
            "wall_s": round(wall, 3), "tokens_per_s": round(sum(tokens) / wall, 2),
            "mean_latency_s": round(statistics.mean(latencies), 3) if latencies else None, "errors": len(errors),
            "error_kinds": sorted(set(errors))}


async def load_test(args: argparse.Namespace) -> list[dict[str, Any]]:
    chats = read_chat_prompts(args.prompts)
    url = args.url.rstrip("/")
    async with httpx.AsyncClient(timeout=args.timeout, limits=httpx.Limits(max_connections=max(args.concurrency) + 4)) as client:
        listed = await client.get(url + "/v1/models")  # also: is anything there (a refused connection raises)
        model = args.model or listed.json()["data"][0]["id"]
        await one_level(client, url, model, chats, 1, 1, min(args.max_tokens, 16))  # warm-up
        return [await one_level(client, url, model, chats, c, args.rounds, args.max_tokens) for c in args.concurrency]


def print_table(levels: list[dict[str, Any]]) -> None:
    base = levels[0]["tokens_per_s"] or 1.0
    print(f"{'streams':>7} {'requests':>8} {'tokens':>7} {'wall s':>7} {'tok/s':>9} {'x one':>6} {'latency s':>9} {'errors':>6}")
    for row in levels:
        print(f"{row['concurrency']:>7} {row['requests']:>8} {row['completion_tokens']:>7} {row['wall_s']:>7.2f} "
              f"{row['tokens_per_s']:>9.2f} {row['tokens_per_s'] / base:>6.2f} {row['mean_latency_s'] or 0:>9.2f} "
              f"{row['errors']:>6}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser("python -m runtime.loadtest", __doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id to send (default: the first one /v1/models lists)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL with 'messages' or 'prompt' per line")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=2, help="requests each client sends in turn")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        levels = anyio.run(load_test, args)
    except httpx.TransportError as exc:
        raise RequestError("url", f"cannot reach {args.url} ({exc or type(exc).__name__}): is the server running?") from None
    print_json({"url": args.url, "max_tokens": args.max_tokens, "levels": levels}) if args.json else print_table(levels)


if __name__ == "__main__":
    run_cli(main)
