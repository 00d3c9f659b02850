"""python -m runtime.training.compare on the real model: drafters side by side on one plain decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol import GenerationParams
from runtime.defaults import default_drafter_path
from runtime.loading import LoadedModel
from runtime.training import compare


@pytest.fixture()
def code_set(tmp_path: Path) -> Path:
    path = tmp_path / "code.jsonl"
    lines = [{"prompt": "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"},
             {"messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.mark.slow
def test_compare_ranks_the_trained_drafter_above_random_weights_with_every_output_exact(
        smollm2: LoadedModel, code_set: Path) -> None:
    bundled = str(default_drafter_path())
    report = compare.compare(smollm2, [bundled, "random:5"], [code_set], GenerationParams(max_tokens=24, block_size=16))
    trained, random = report["drafters"][bundled]["code"], report["drafters"]["random:5"]["code"]
    assert trained["equal"] == random["equal"] == 2  # float32: both reproduce plain greedy
    assert trained["tau"] > 1.5 and random["tau"] < trained["tau"]


@pytest.mark.slow
def test_compare_prints_one_row_per_drafter_and_one_column_per_set(code_set: Path, capsys: pytest.CaptureFixture[str],
                                                                  smollm2: LoadedModel) -> None:
    compare.main(["--drafts", "random:3", "random:5", "--prompts", str(code_set), "--max-tokens", "8", "--dtype", "float32"])
    table = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("drafter"))
    assert table[header].split() == ["drafter", "code"]
    assert [line.split()[0] for line in table[header + 1:]] == ["random:3", "random:5"]
    assert all(line.split()[2] == "(2/2)" for line in table[header + 1:])
