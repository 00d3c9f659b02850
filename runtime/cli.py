"""Argument pieces shared by the command-line entry points."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Callable

from protocol import GenerationParams

from .errors import RuntimeErrorBase


def new_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """An entry point's parser: its docstring's first line as description, defaults shown in --help."""
    return argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0],
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="target: HF or MLX-quantized folder, a .gguf file, or random:qwen3-8b, random:qwen3-4b, "
                        "random:llama-3.1-8b (published shapes, random weights; -4bit/-8bit quantized) "
                        "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", help="compute dtype: auto (float32 on CPU, native on GPU), native, float32, float16, bfloat16")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    parser.add_argument("--temperature", "--temp", type=float, default=0.0, help="below 1e-5 (0 too) means greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
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


def _console_script(module: str) -> Callable[[], None]:
    """The ``dflash-*`` command for ``python -m <module>`` (pyproject's [project.scripts])."""
    def script() -> None:
        main = importlib.import_module(module).main
        run_cli(lambda: sys.exit(main() or 0))
    return script


generate = _console_script("runtime.generate")
serve = _console_script("runtime.serve")
bench = _console_script("runtime.bench")
loadtest = _console_script("runtime.loadtest")
replay = _console_script("runtime.replay.cli")
train = _console_script("runtime.train")
convert = _console_script("runtime.convert")
