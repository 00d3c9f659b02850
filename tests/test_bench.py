"""python -m runtime.bench on tiny float32 fixtures: every mode runs, and the report says what it must."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime import bench
from runtime.engine import MODES


@pytest.fixture()
def prompts(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "The quick brown fox"}, {"messages": [{"role": "user", "content": "Hello there"}]}, {"prompt": "abc"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_bench_json_reports_every_mode_and_equal_outputs(tiny_llama_dir: Path, tiny_drafter_dir: Path, prompts: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--prompts", str(prompts),
                "--max-tokens", "12", "--block-size", "4", "--dtype", "float32", "--json", "--repeat", "2"])
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 3 and report["block_size"] == 4
    for key in ("plain", "reference", "sequential", "dflash", "pipelined2", "draft-ahead"):  # every mode ran twice; both runs pooled are reported
        runs = report[key]["runs_tokens_per_s"]
        assert len(runs) == 2 and min(runs) <= report[key]["tokens_per_s"] <= max(runs)
    for key in ("plain", "reference", "sequential", "dflash"):
        assert report[key]["tokens_per_s"] > 0
    assert report["dflash"]["tau"] >= 1.0 and len(report["dflash"]["acceptance_per_position"]) == 3
    assert report["exact"] is True  # float32: speculative output equals plain greedy in every mode
    assert report["equal_outputs_per_mode"] == {"reference": 3, **{mode: 3 for mode in MODES}}
    assert report["speedup"] == pytest.approx(report["dflash"]["tokens_per_s"] / report["plain"]["tokens_per_s"], rel=1e-2)


def test_bench_table_names_each_mode(tiny_llama_dir: Path, tiny_drafter_dir: Path, prompts: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--prompts", str(prompts),
                "--max-tokens", "8", "--dtype", "float32"])
    table = capsys.readouterr().out
    rows: dict[str, list[str]] = {}
    for line in table.splitlines():
        if line.split():
            rows.setdefault(line.split()[0], line.split())  # the table row, not later lines naming the mode
    for mode in ("reference", *MODES):
        assert rows[mode][-1] == "3/3", rows[mode]  # outputs equal to plain greedy, per mode
    assert "plain" in rows
    assert "acceptance per block position" in table


def test_bench_log_holds_every_engine_request_with_its_rounds(tiny_llama_dir: Path, tiny_drafter_dir: Path, prompts: Path,
                                                               tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.replay.reading import read_log

    log = tmp_path / "bench.jsonl"
    bench.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--prompts", str(prompts),
                "--max-tokens", "8", "--block-size", "4", "--dtype", "float32", "--json", "--log", str(log), "--repeat", "2"])
    report = json.loads(capsys.readouterr().out)
    replay = read_log(log)
    assert not replay.problems
    assert len(replay.requests) == 3 * len(MODES) * 2  # the timed runs: each prompt once per engine mode and repeat
    assert all(r.finish is not None and r.finish.finish_reason == "length" for r in replay.requests.values())
    rounds = sum(len(r.rounds) for r in replay.requests.values())
    assert rounds == sum(report["dflash" if mode == "pipelined" else mode]["rounds"] for mode in MODES)


def test_bench_without_the_engine_reports_tau_and_exactness_of_the_reference_loop(
        tiny_llama_dir: Path, tiny_drafter_dir: Path, prompts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--prompts", str(prompts),
                "--max-tokens", "10", "--block-size", "4", "--dtype", "float32", "--json", "--no-engine"])
    report = json.loads(capsys.readouterr().out)
    assert "sequential" not in report and "dflash" not in report
    assert report["reference"]["tau"] >= 1.0 and report["equal_outputs_per_mode"] == {"reference": 3}
    per_prompt = report["reference"]["tau_per_prompt"]
    assert [row["name"] for row in per_prompt] == ["line1", "line2", "line3"]
    taus = [row["tau"] for row in per_prompt]
    assert min(taus) >= 1.0 and min(taus) <= report["reference"]["tau"] <= max(taus)  # the pooled tau weighs them by rounds
    assert report["speedup"] == pytest.approx(report["reference"]["tokens_per_s"] / report["plain"]["tokens_per_s"], rel=1e-2)


def test_bench_concurrency_runs_engine_groups_at_once_with_equal_outputs(
        tiny_llama_dir: Path, tiny_drafter_dir: Path, prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from runtime.replay.reading import read_log

    log = tmp_path / "bench.jsonl"
    bench.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--prompts", str(prompts),
                "--max-tokens", "10", "--block-size", "4", "--dtype", "float32", "--json", "--concurrency", "2",
                "--log", str(log)])
    report = json.loads(capsys.readouterr().out)
    assert report["concurrency"] == 2
    assert report["equal_outputs_per_mode"] == {"reference": 3, **{mode: 3 for mode in MODES}}
    batches = [r.batch_size for q in read_log(log).requests.values() for r in q.rounds]
    assert max(batches) == 2  # a group of two shared forwards; the third prompt ran alone
    for key in ("sequential", "dflash", "pipelined2", "draft-ahead"):
        assert report[key]["tokens_per_s"] > 0


def test_bench_refuses_a_concurrency_below_one(tiny_llama_dir: Path, tiny_drafter_dir: Path, prompts: Path) -> None:
    from runtime.errors import RequestError

    with pytest.raises(RequestError, match="concurrency"):
        bench.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--prompts", str(prompts),
                    "--max-tokens", "4", "--dtype", "float32", "--concurrency", "0"])


def test_a_random_drafter_on_a_shallow_target_taps_distinct_layers_and_runs_every_mode(
        tiny_llama_dir: Path, prompts: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the tiny target has 4 layers: five taps spread over layers 1..1 would repeat layer 1
    bench.main(["--model", str(tiny_llama_dir), "--draft", "random:5", "--prompts", str(prompts),
                "--max-tokens", "10", "--block-size", "4", "--dtype", "float32", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["equal_outputs_per_mode"] == {"reference": 3, **{mode: 3 for mode in MODES}}
    assert report["dflash"]["rounds"] > 0


def test_bench_modes_runs_only_the_engine_modes_named_and_names_the_split(
        tiny_llama_dir: Path, tiny_drafter_dir: Path, tmp_path: Path, prompts: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    test_set = tmp_path / "test" / "chat.jsonl"
    test_set.parent.mkdir()
    test_set.write_text(prompts.read_text())
    bench.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--prompts", str(test_set),
                "--max-tokens", "8", "--block-size", "4", "--dtype", "float32", "--json", "--modes", "pipelined"])
    report = json.loads(capsys.readouterr().out)
    assert report["split"] == "test" and report["prompt_set"] == str(test_set)
    assert report["equal_outputs_per_mode"] == {"reference": 3, "pipelined": 3}
    assert "dflash" in report and not {"sequential", "pipelined2", "draft-ahead"} & set(report)
    assert report["speedup"] == pytest.approx(report["dflash"]["tokens_per_s"] / report["plain"]["tokens_per_s"], rel=1e-2)
    bench.main(["--model", str(tiny_llama_dir), "--draft", str(tiny_drafter_dir), "--prompts", str(prompts),
                "--max-tokens", "8", "--block-size", "4", "--dtype", "float32", "--modes", "sequential"])
    table = capsys.readouterr().out
    assert "unsplit split" in table and "sequential" in table and "pipelined2" not in table
