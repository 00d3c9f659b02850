"""``python -m runtime.generate``: one generation from the command line.

    python -m runtime.generate --prompt "What is the capital of France?" --max-tokens 32
    python -m runtime.generate --prompt "def fib(n):" --ignore-chat-template --temp 0.7 --seed 1 --log run.jsonl

With a drafter the generation runs through the actor engine (``--mode``), so ``--log``
writes the run log ``python -m runtime.replay`` reads; ``--draft none`` decodes plainly.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import anyio

from protocol import GenerationParams, TokenEvent

from .branches import MAX_BRANCHES
from .cli import add_model_arguments, add_sampling_arguments, new_parser, params_from_args, print_json, run_cli
from .defaults import default_drafter_path, default_model_path
from .drafters import resolve_drafter
from .engine import MODES, Engine, drafter_identity
from .errors import RequestError
from .loading import LoadedModel, load_target
from .plain import generate_plain, run_to_end
from .tokenizer import Tokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser("python -m runtime.generate", __doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt: a user message in the model's chat template where it has one "
                        "(as mlx-lm does), else text as is")
    source.add_argument("--chat", help="a user message in the model's chat template (the same as --prompt on a chat model)")
    parser.add_argument("--ignore-chat-template", action="store_true", help="feed --prompt as raw text (code to continue)")
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.add_argument("--draft", help="DFlash drafter folder (z-lab format, DFlash 1 or 2), random:L (random:L:dflash2: "
                        "a DFlash 2 one), or none for plain decoding "
                        "(default: the bundled drafter when the model is the default one, else none)")
    parser.add_argument("--block-size", type=int, default=None, help="speculative block (default: the drafter's)")
    parser.add_argument("--mode", choices=sorted(MODES), default="pipelined", help="the engine's round schedule")
    parser.add_argument("--branches", type=int, choices=range(1, MAX_BRANCHES + 1), default=1, metavar="K",
                        help="blocks every round drafts and verifies, keeping the one accepted furthest (greedy requests)")
    parser.add_argument("--log", type=Path, help="write the run log (JSON lines) that python -m runtime.replay reads")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return parser.parse_args(argv)


def prompt_ids(tokenizer: Tokenizer, args: argparse.Namespace) -> list[int]:
    if args.chat is not None or (tokenizer.chat_template is not None and not args.ignore_chat_template):
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.chat or args.prompt}])
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(args.prompt)


def default_draft(model: Path) -> str | None:
    """The bundled drafter (None) for the default model, named or not; plain decoding for any other."""
    bundled = default_drafter_path() is not None and model.resolve() == default_model_path().resolve()
    return None if bundled else "none"


def event_json(text: str, ids: list[int], last: TokenEvent) -> dict[str, Any]:
    decode = float(last.timings.get("decode_s", 0.0))
    usage = last.usage
    return {
        "text": text, "token_ids": ids, "finish_reason": last.finish_reason,
        "usage": {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                  "total_tokens": usage.total_tokens} if usage else None,
        "timings": {"ttft_s": round(float(last.timings.get("ttft_s", 0.0)), 4),
                    "tokens_per_s": round((len(ids) - 1) / decode, 2) if decode > 0 and len(ids) > 1 else 0.0},
        **last.stats,
    }


async def speculative(loaded: LoadedModel, draft: str | None, ids: list[int], params: GenerationParams,
                      args: argparse.Namespace) -> None:
    drafter = resolve_drafter(draft, loaded, block_size=args.block_size or 16)
    engine = Engine(loaded, drafter, mode=args.mode, log=args.log, drafter_identity=drafter_identity(draft),
                    branches=args.branches)
    tokens: list[int] = []
    parts: list[str] = []
    last: TokenEvent | None = None
    async with engine:
        async for last in engine.generate(ids, params):
            tokens += last.token_ids
            parts.append(last.text)
            if not args.json:
                sys.stdout.write(last.text)
                sys.stdout.flush()
    assert last is not None
    if last.finish_reason == "error":
        raise RequestError("generation", str(last.error))
    print_json(event_json("".join(parts), tokens, last)) if args.json else print()


def plain(loaded: LoadedModel, ids: list[int], params: GenerationParams, args: argparse.Namespace) -> None:
    emissions = generate_plain(loaded.model, loaded.tokenizer, ids, params)
    if not args.json:
        emissions = _echo(emissions)
    result = run_to_end(emissions, len(ids))
    if args.json:
        print_json({"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
                    "usage": result.usage,
                    "timings": {"ttft_s": round(result.ttft_s, 4), "tokens_per_s": round(result.tokens_per_s, 2)}})
    else:
        print()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    draft = args.draft if args.draft is not None else default_draft(model)
    if draft == "none" and args.log:
        raise RequestError("log", "the run log records speculative rounds: --log needs a drafter, not --draft none")
    loaded = load_target(model, dtype=args.dtype)
    ids = prompt_ids(loaded.tokenizer, args)
    params = params_from_args(args, block_size=args.block_size)
    if draft == "none":
        plain(loaded, ids, params, args)
    else:
        anyio.run(speculative, loaded, draft, ids, params, args)


def _echo(emissions):  # type: ignore[no-untyped-def]
    for emission in emissions:
        sys.stdout.write(emission.text)
        sys.stdout.flush()
        yield emission


if __name__ == "__main__":
    run_cli(main)
