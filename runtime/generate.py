"""``python -m runtime.generate``: one generation from the command line.

    python -m runtime.generate --chat "What is the capital of France?" --max-tokens 32
"""

from __future__ import annotations

import argparse
import sys

from .cli import add_model_arguments, add_sampling_arguments, params_from_args, print_json, run_cli
from .defaults import default_drafter_path, default_model_path
from .loading import load_target
from .drafters import resolve_drafter
from .plain import GenerationResult, generate_plain, run_to_end
from .speculative import SpeculativeStats, block_size_for, generate_speculative


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime.generate", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--chat", help="a user message, rendered with the model's chat template")
    source.add_argument("--prompt", help="raw prompt text, fed as is")
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    parser.add_argument("--draft", help="DFlash drafter folder (z-lab format), random:L, or none for plain decoding "
                        "(default: the bundled drafter when the model is the default one, else none)")
    parser.add_argument("--block-size", type=int, default=None, help="speculative block (default: the drafter's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return parser.parse_args(argv)


def result_json(result: GenerationResult) -> dict[str, object]:
    return {
        "text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
        "usage": result.usage,
        "timings": {"ttft_s": round(result.ttft_s, 4), "tokens_per_s": round(result.tokens_per_s, 2)},
        **result.stats,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    loaded = load_target(args.model or default_model_path(), dtype=args.dtype)
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.chat}]) if args.chat is not None else args.prompt
    prompt_ids = tok.encode(text, add_special_tokens=args.chat is None)
    params = params_from_args(args, block_size=args.block_size)
    stats = SpeculativeStats()
    draft = args.draft or ("none" if args.model or default_drafter_path() is None else None)
    if draft != "none":
        drafter = resolve_drafter(draft, loaded)
        emissions = generate_speculative(loaded.model, drafter, tok, prompt_ids, params, stats)
    else:
        emissions = generate_plain(loaded.model, tok, prompt_ids, params)
    if not args.json:
        emissions = _echo(emissions)
    result = run_to_end(emissions, len(prompt_ids))
    if draft != "none":
        result.stats = stats.summary(block_size_for(drafter, params))
    if args.json:
        print_json(result_json(result))
    else:
        print()


def _echo(emissions):  # type: ignore[no-untyped-def]
    for emission in emissions:
        sys.stdout.write(emission.text)
        sys.stdout.flush()
        yield emission


if __name__ == "__main__":
    run_cli(main)
