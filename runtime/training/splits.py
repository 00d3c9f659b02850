"""Training, validation and test splits by source (docs/evaluation.md).

A drafter is trained on the training sources, chosen (checkpoint, learning rate, data mix,
averages) on the validation split, and reported on the test split, which chooses nothing.
Both evaluation splits come from sources no training prompt comes from, so their figures
say how a drafter does on text nobody tuned it for, not how well it fits its own data:

- code: HumanEval (evaluation only; the trainer refuses it), problems 0-39 for validation
  (earlier sessions looked at them while tuning) and 40-163 for test, each as code to
  continue and as a plain-English request;
- math: whole reasoning-gym task families that training never draws from (word problems),
  one group for validation and another for test; gsm_symbolic seeds 1-99 (the trained
  generator, unseen seeds) stay a validation set, in distribution;
- chat: everyday requests and conversations written for this project
  (runtime/data/chat_written.jsonl), split by hash, a third for validation; chatterbot's
  held-out lines (a trained corpus's other 2%) stay a validation set, in distribution.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# reasoning-gym families held out of training whole: math word problems in plain English
VALIDATION_FAMILIES = ("calendar_arithmetic", "family_relationships", "advanced_geometry", "bitwise_arithmetic")
TEST_FAMILIES = ("aiw", "leg_counting", "time_intervals", "coin_flip", "dice", "simple_geometry")
# families that are training sources of their own (gsm, code, code-def) or not a task at all
OWN_SOURCE_FAMILIES = ("gsm_symbolic", "codeio", "composite")
EVALUATION_FAMILIES = frozenset(VALIDATION_FAMILIES + TEST_FAMILIES)

HUMANEVAL_SPLITS = {"validation": range(0, 40), "test": range(40, 164)}
SPLITS = ("validation", "test")
WRITTEN_CHAT = Path(__file__).resolve().parent.parent / "data" / "chat_written.jsonl"
WRITTEN_VALIDATION_SHARE = 1 / 3


def written_chat(split: str) -> list[dict[str, object]]:
    """The project's own chat prompts of ``split`` (records with ``name`` and ``messages``)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return [row for row in written_chat_rows() if _written_split(row) == split]


def written_chat_rows() -> list[dict[str, object]]:
    """Every written chat prompt, both splits: training must never see one (runtime.training.corpora)."""
    return [json.loads(line) for line in WRITTEN_CHAT.read_text(encoding="utf-8").splitlines() if line.strip()]


def _written_split(row: dict[str, object]) -> str:
    digest = hashlib.sha256(json.dumps(row["messages"], ensure_ascii=False).encode()).hexdigest()
    return "validation" if int(digest[:16], 16) < WRITTEN_VALIDATION_SHARE * 2**64 else "test"


def split_of(prompts: Path) -> str:
    """Which split a prompt set belongs to, by the folder runtime.evalsets wrote it in; reports
    name it beside every figure ("unsplit" for sets made otherwise: no claim about their sources)."""
    return prompts.parent.name if prompts.parent.name in SPLITS else "unsplit"
