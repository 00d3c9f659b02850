"""python -m runtime.training.questions: the target writes chat prompts, and they read back as training data."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.loading import LoadedModel
from runtime.training.corpora import DataError, file_prompts
from runtime.training.questions import ASKS, ask_prompts, extract_question, main, topics, write_questions


@pytest.mark.parametrize("reply, question", [
    ('A person might ask: "What\'s a robot\'s favorite hobby?"', "What's a robot's favorite hobby?"),
    ("Which planet is the largest in our solar system?\nIt is Jupiter.", "Which planet is the largest in our solar system?"),
    ("A curious child might ask: Why is the sky blue?", "Why is the sky blue?"),
    ("Question: What is the tallest mountain on Earth?", "What is the tallest mountain on Earth?"),
    ('"What\'s the history of the [insert historical event]?"', None),  # a placeholder, not a question
    ("Why?", None),  # too short to be a prompt
    ('A friendly chatbot might say, "Hey there, I am here to help with your business, but', None),  # cut short
])
def test_extract_question_takes_the_quoted_or_first_line_and_refuses_fragments(reply: str, question: str | None) -> None:
    assert extract_question(reply) == question


def test_the_target_writes_questions_that_read_back_as_chat_prompts(smollm2: LoadedModel, tmp_path: Path) -> None:
    asks = [ask.format(topic) for topic in ("robots", "the moon") for ask in ASKS[:2]]
    out = tmp_path / "self-chat.jsonl"
    written = write_questions(smollm2, asks, out, batch_size=4)
    prompts = file_prompts(out)
    assert 1 <= written == len(prompts) <= len(asks)
    assert all(p.messages and p.messages[0][0] == "user" and 8 <= len(p.messages[0][1]) <= 200 for p in prompts)
    assert any(p.messages[0][1].endswith("?") for p in prompts)


def test_asks_cover_every_topic_with_every_template() -> None:
    try:
        names = topics()
    except DataError as exc:
        pytest.skip(f"corpus packages not installed: {exc}")
    assert "artificial intelligence" in names and len(names) == len(set(names)) > 100
    assert "Athens" in names and "intelligent" in names  # an analogy word; a SimLex-999 word alone
    assert ask_prompts(limit=len(ASKS))[0] == ASKS[0].format(names[0]) and len(ask_prompts()) == len(ASKS) * len(names)


def test_topics_written_where_the_corpora_are_read_back_where_they_are_not(tmp_path: Path) -> None:
    try:
        names = topics()
    except DataError as exc:
        pytest.skip(f"corpus packages not installed: {exc}")
    written = tmp_path / "topics.txt"
    main(["--out", str(tmp_path / "unused.jsonl"), "--write-topics", str(written)])
    assert written.read_text(encoding="utf-8").splitlines() == names
    assert ask_prompts(topic_list=["tea", "chess"]) == [ask.format(t) for t in ("tea", "chess") for ask in ASKS]
