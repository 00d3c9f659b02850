"""The command-line entry points as a user runs them: real processes, the real default model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.defaults import default_drafter_path, default_model_path
from runtime.loading import LoadedModel

ROOT = Path(__file__).parents[1]
QUESTION = "What is the capital of France?"


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def generate_json(*args: str) -> dict:
    return json.loads(run("runtime.generate", "--max-tokens", "24", "--json", *args).stdout)


@pytest.mark.usefixtures("smollm2")
def test_generate_log_is_what_replay_audits_and_reruns_with_the_bundled_drafter(tmp_path: Path) -> None:
    log = tmp_path / "run.jsonl"
    out = run("runtime.generate", "--prompt", QUESTION, "--max-tokens", "32", "--log", str(log))
    assert "Paris" in out.stdout
    audit = run("runtime.replay", str(log))
    assert "every round passes" in audit.stdout and "every output rebuilds exactly" in audit.stdout
    rerun = run("runtime.replay", str(log), "--rerun")
    assert "output identical" in rerun.stdout


@pytest.mark.usefixtures("smollm2")
def test_prompt_gets_the_chat_template_as_in_mlx_lm_unless_ignored() -> None:
    chat = generate_json("--chat", QUESTION)
    assert generate_json("--prompt", QUESTION)["token_ids"] == chat["token_ids"] and "Paris" in chat["text"]
    raw = generate_json("--prompt", "def fib(n):", "--ignore-chat-template")
    assert raw["usage"]["prompt_tokens"] < 8  # the text alone, no template around it


@pytest.mark.usefixtures("smollm2")
def test_naming_the_default_model_keeps_the_bundled_drafter() -> None:
    if default_drafter_path() is None:
        pytest.skip("no bundled drafter")
    named = generate_json("--chat", QUESTION, "--model", str(default_model_path()))
    assert named["tau"] > 1 and named["token_ids"] == generate_json("--chat", QUESTION, "--draft", "none")["token_ids"]


def test_help_shows_the_defaults() -> None:
    assert "(default: 256)" in run("runtime.generate", "--help").stdout
    assert "(default: 30.0)" in run("runtime.serve", "--help").stdout


def test_bad_input_gets_one_line_and_exit_status_2(tmp_path: Path, smollm2: LoadedModel) -> None:
    broken = tmp_path / "broken-drafter"
    broken.mkdir()
    bundled = default_drafter_path()
    assert bundled is not None
    (broken / "config.json").write_text((bundled / "config.json").read_text())
    (broken / "model.safetensors").write_bytes((bundled / "model.safetensors").read_bytes()[:100_000])
    cases = {
        "prompts": ["runtime.bench", "--prompts", str(tmp_path / "missing.jsonl")],
        "server": ["runtime.loadtest", "--url", "http://127.0.0.1:9", "--concurrency", "1"],
        "model": ["runtime.serve", "--model", str(tmp_path / "nonexistent")],
        "random:0": ["runtime.generate", "--chat", "hi", "--draft", "random:0", "--max-tokens", "2"],
        "fc.": ["runtime.generate", "--chat", "hi", "--draft", str(broken), "--max-tokens", "2"],
    }
    for expected, args in cases.items():
        done = run(*args, check=False)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr[-2000:])
        assert lines[-1].startswith("error: ") and expected in lines[-1], (args, lines[-1])
