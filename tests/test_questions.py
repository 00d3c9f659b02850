"""python -m runtime.training.questions: the target writes chat prompts, and they read back as training data."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.loading import LoadedModel
from runtime.training.corpora import DataError, file_prompts
from runtime.training.questions import (ASKS, LIKE_ASKS, ask_prompts, canonical, chat_lines, extract_question, like_prompts, main,
                                        seed_lines, topics, write_questions)


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
    assert ask_prompts()[0] == ASKS[0].format(names[0]) and len(ask_prompts()) == len(ASKS) * len(names)


def test_topics_written_where_the_corpora_are_read_back_where_they_are_not(tmp_path: Path) -> None:
    try:
        names = topics()
    except DataError as exc:
        pytest.skip(f"corpus packages not installed: {exc}")
    written = tmp_path / "topics.txt"
    main(["--out", str(tmp_path / "unused.jsonl"), "--write-topics", str(written)])
    assert written.read_text(encoding="utf-8").splitlines() == names
    assert ask_prompts(["tea", "chess"]) == [ask.format(t) for t in ("tea", "chess") for ask in ASKS]


def test_prompts_the_target_writes_equal_to_a_known_line_are_dropped(smollm2: LoadedModel, tmp_path: Path) -> None:
    asks = [ask.format("robots") for ask in ASKS[:3]]
    first = tmp_path / "first.jsonl"
    assert write_questions(smollm2, asks, first, batch_size=3) >= 1
    known = frozenset(canonical(p.messages[0][1]) for p in file_prompts(first))
    assert write_questions(smollm2, asks, tmp_path / "again.jsonl", batch_size=3, known=known) == 0


def test_canonical_lines_ignore_case_punctuation_and_spacing() -> None:
    assert canonical("Are you  a Programmer?") == canonical("are you a programmer") != canonical("Are you a poet?")


def test_like_chat_asks_quote_training_lines_and_held_out_lines_are_known() -> None:
    from runtime.evalsets import chat

    try:
        lines, known, heldout = chat_lines()
    except DataError as exc:
        pytest.skip(f"corpus packages not installed: {exc}")
    rows = chat(40)
    single = [row["messages"][0]["content"] for row in rows if len(row["messages"]) == 1]
    every = [m["content"] for row in rows for m in row["messages"]]
    assert len(rows) == 37 and len(single) > 30 and not set(single) & set(lines) and len(lines) > 1000
    assert all(canonical(line) in known for line in every + lines)  # so none comes out as a new prompt
    assert all(canonical(line) in heldout for line in every) and not heldout & {canonical(line) for line in lines}
    assert like_prompts(lines[:2]) == [ask.format(line) for line in lines[:2] for ask in LIKE_ASKS]


def test_seed_lines_are_the_one_message_prompts_of_earlier_output_once(tmp_path: Path) -> None:
    first, second = tmp_path / "like-chat-1.jsonl", tmp_path / "like-chat-2.jsonl"
    first.write_text('{"messages": [{"role": "user", "content": "Do you like rain?"}]}\n'
                     '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},'
                     ' {"role": "user", "content": "How are you?"}]}\n')
    second.write_text('{"messages": [{"role": "user", "content": "Do you like rain?"}]}\n'
                      '{"messages": [{"role": "user", "content": "Tell me a joke."}]}\n')
    assert seed_lines([first, second]) == ["Do you like rain?", "Tell me a joke."]
    assert seed_lines([first, second], refused={canonical("do you like RAIN")}) == ["Tell me a joke."]  # held-out lines


def test_seeds_need_like_chat(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "out.jsonl"), "--seeds", str(tmp_path / "seeds.jsonl")])
