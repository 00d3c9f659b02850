"""Argument pieces shared by the command-line entry points."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from protocol import GenerationParams

from .errors import RuntimeErrorBase


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="target: HF or MLX-quantized folder, or a .gguf file (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="compute dtype: auto (float32 on CPU, native on GPU), native, float32, float16, bfloat16")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def params_from_args(args: argparse.Namespace, **extra: Any) -> GenerationParams:
    return GenerationParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), **extra,
    )


def print_json(obj: Any) -> None:
    print(json.dumps(obj, ensure_ascii=False))


def run_cli(main: Any) -> None:
    """Run ``main()``; the project's own errors print as one line and exit 2, no traceback."""
    try:
        main()
    except RuntimeErrorBase as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
