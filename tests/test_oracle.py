"""Oracle acceptance (runtime.oracle): a fixed number of drafts accepted a round, output still exact."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from protocol import GenerationParams
from runtime import bench
from runtime.bench import oracle_drafter, run_dflash, run_plain, run_together
from runtime.convert import export
from runtime.engine import MODES
from runtime.errors import CheckpointError, RequestError
from runtime.loading import LoadedModel, load_checkpoint
from runtime.random_targets import random_checkpoint

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1500}
PARAMS = GenerationParams(max_tokens=365)  # 364 tokens after the first: whole rounds at tau 2, 4, 7 and 13


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return load_checkpoint(random_checkpoint("random:qwen3-8b", overrides=SMALL), "float32")


def prompts(target: LoadedModel) -> list[list[int]]:
    return [target.tokenizer.encode(text) for text in ("def add(a, b):", "Tell me a story about a robot. " * 3)]


@pytest.mark.parametrize("tau", [2.0, 4.0, 7.0, 13.0])
def test_an_oracle_round_delivers_exactly_tau_tokens_and_the_output_stays_plain_greedy(target: LoadedModel, tau: float) -> None:
    drafter = oracle_drafter(target, "random:2", tau, 16)
    for ids in prompts(target):
        result, stats = run_dflash(target, drafter, ids, PARAMS)
        assert result.token_ids == run_plain(target, ids, PARAMS).token_ids
        assert {r.facts.accepted for r in stats.rounds} == {tau - 1}
        assert stats.summary(16)["tau"] == pytest.approx(tau)


def test_every_engine_mode_accepts_what_the_oracle_fixes_alone_and_batched(target: LoadedModel) -> None:
    drafter = oracle_drafter(target, "random:2", 4.0, 16)
    ids = prompts(target)
    want = [run_plain(target, p, PARAMS).token_ids for p in ids]
    for mode in MODES:
        group = anyio.run(run_together, target, drafter, ids, PARAMS, mode)
        assert [tokens for tokens, _ in group.results] == want, mode
        assert {event.stats["tau"] for _, event in group.results} == {4.0}, mode


def test_a_fractional_oracle_tau_mixes_two_acceptance_lengths(target: LoadedModel) -> None:
    drafter = oracle_drafter(target, "random:2", 6.5, 16)
    params = GenerationParams(max_tokens=600)
    result, stats = run_dflash(target, drafter, prompts(target)[0], params)
    assert result.token_ids == run_plain(target, prompts(target)[0], params).token_ids
    assert {r.facts.accepted for r in stats.rounds[:-1]} == {5, 6}
    assert stats.summary(16)["tau"] == pytest.approx(6.5, abs=0.4)


def test_an_oracle_tau_beyond_the_block_is_refused(target: LoadedModel) -> None:
    with pytest.raises(RequestError, match="oracle_tau"):
        oracle_drafter(target, "random:2", 9.0, 8)  # 7 drafts a block: tau 8 at most


def test_the_oracle_needs_a_random_target(tiny_llama: LoadedModel) -> None:
    with pytest.raises(CheckpointError, match="not built by runtime.random_targets"):
        oracle_drafter(tiny_llama, "random:2", 4.0, 16)


def test_bench_names_the_oracle_in_its_report(target: LoadedModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    unfused = load_checkpoint(random_checkpoint("random:qwen3-8b", overrides=SMALL), "float32", fuse=False)
    export(unfused, tmp_path / "model")  # a random target as a folder keeps its greedy successor
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    argv = ["--model", str(tmp_path / "model"), "--draft", "random:2", "--oracle-tau", "5", "--prompts", str(prompts_file),
            "--max-tokens", "41", "--dtype", "float32"]
    bench.main([*argv, "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["oracle_tau"] == 5.0 and report["exact"] is True
    assert report["reference"]["tau"] == pytest.approx(5.0) and report["dflash"]["tau"] == pytest.approx(5.0)
    bench.main(argv)
    assert "ORACLE acceptance (a measuring instrument" in capsys.readouterr().out
