"""python -m runtime.replay: logs of real engine runs rebuild, audit, summarise, trace and rerun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import anyio
import pytest

from protocol import GenerationParams
from runtime.engine import Engine
from runtime.replay.audit import audit_request, rebuilt_output
from runtime.replay.cli import main
from runtime.replay.reading import ReplayError, read_log
from runtime.replay.trace import nesting_problems

from . import fixtures

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [40, 41, 42, 43]]
GREEDY = GenerationParams(max_tokens=16, block_size=4)
SAMPLED = GenerationParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=3, block_size=4)


async def _collect(engine: Engine, prompt: list[int], params: GenerationParams) -> list[int]:
    ids: list[int] = []
    async for event in engine.generate(prompt, params):
        ids += event.token_ids
    return ids


def record(log: Path, model: Path, draft: Path | str, jobs: list[tuple[list[int], GenerationParams]],
           mode: str = "pipelined") -> list[list[int]]:
    """Run the jobs concurrently on one engine that logs to ``log``; their streamed tokens."""
    results: dict[int, list[int]] = {}

    async def run() -> None:
        async with Engine.load(model, draft, log=log, mode=mode) as engine:
            async def one(i: int) -> None:
                results[i] = await _collect(engine, *jobs[i])

            async with anyio.create_task_group() as tg:
                for i in range(len(jobs)):
                    tg.start_soon(one, i)

    anyio.run(run)
    return [results[i] for i in range(len(jobs))]


@pytest.fixture(scope="module")
def recorded(tiny_llama_dir: Path, tiny_drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[int]]]:
    """One log, two engines appended: pipelined greedy + sampled, then sequential greedy with a stop string."""
    log = tmp_path_factory.mktemp("replay") / "run.jsonl"
    greedy, sampled = record(log, tiny_llama_dir, tiny_drafter_dir, [(PROMPTS[0], GREEDY), (PROMPTS[1], SAMPLED)])
    probe = read_log(log).requests["req-0"].finish
    assert probe is not None
    stop = GenerationParams(max_tokens=16, block_size=4, stop=(probe.text[6:8],))  # cuts the greedy text short
    (stopped,) = record(log, tiny_llama_dir, tiny_drafter_dir, [(PROMPTS[0], stop)], mode="sequential")
    return log, {"req-0": greedy, "req-1": sampled, "req-0#2": stopped}


def replay_json(*argv: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def edited(log: Path, out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the log with ``edit`` applied to every record (as a dict)."""
    lines = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        edit(record)
        lines.append(json.dumps(record))
    out.write_text("\n".join(lines) + "\n")
    return out


def test_recorded_runs_rebuild_their_streamed_output_and_pass_the_audit(recorded: Any, capsys: Any) -> None:
    log, streamed = recorded
    replay = read_log(log)
    assert list(replay.requests) == ["req-0", "req-1", "req-0#2"] and not replay.problems
    for key, ids in streamed.items():
        request = replay.requests[key]
        assert request.finish is not None and request.finish.token_ids == ids
        assert rebuilt_output(request)[: len(ids)] == ids
        assert audit_request(request) == []
    reasons = {key: replay.requests[key].finish.finish_reason for key in streamed}  # type: ignore[union-attr]
    assert reasons == {"req-0": "length", "req-1": "length", "req-0#2": "stop"}
    assert len(streamed["req-0#2"]) < len(streamed["req-0"])
    code, report = replay_json(str(log), capsys=capsys)
    assert code == 0 and report["ok"] and report["findings"] == [] and report["problems"] == []
    summary = report["summary"]
    rounds = sum(len(r.rounds) for r in replay.requests.values())
    assert summary["requests"] == 3 and summary["rounds"] == rounds
    assert sum(summary["tau_histogram"].values()) == rounds and len(summary["acceptance_per_position"]) == 3
    assert summary["speculative_rounds"] >= len(replay.requests["req-0"].rounds)  # pipelined: drafted ahead
    assert set(summary["stage_ms"]) == {"drafted -> verify queued", "verify queued -> ready", "ready -> committed"}
    assert summary["gpu_idle_ms"]["gaps"] == rounds - 3
    assert summary["discarded_rounds"] in (None, 0)  # None until the committer logs it; "length" discards none


def _lag(r: dict[str, Any]) -> None:
    r["target_kv_before"] += 1


def _trim(r: dict[str, Any]) -> None:
    r["new_ctx_rows"] += 1


def _rollback(r: dict[str, Any]) -> None:
    r["drafter_ctx_before"] -= 1


def _layout(r: dict[str, Any]) -> None:
    r["tap_shape"] = [r["tap_shape"][0], r["tap_shape"][1] - 1]


def _accepted(r: dict[str, Any]) -> None:
    r["accepted"] += 1


@pytest.mark.parametrize("invariant,edit", [("lag", _lag), ("trim", _trim), ("no-rollback", _rollback),
                                            ("layout", _layout), ("accepted-prefix", _accepted)])
def test_a_log_edited_to_break_an_invariant_names_its_request_round_and_invariant(
        recorded: Any, tmp_path: Path, capsys: Any, invariant: str, edit: Callable[[dict[str, Any]], None]) -> None:
    log, _ = recorded

    def break_req1_round2(record: dict[str, Any]) -> None:
        if record["event"] == "round" and record["request_id"] == "req-1" and record["round"] == 2:
            edit(record)

    bad = edited(log, tmp_path / "bad.jsonl", break_req1_round2)
    code, report = replay_json(str(bad), capsys=capsys)
    assert code == 1 and not report["ok"]
    assert [(f["request"], f["round"], f["check"]) for f in report["findings"]] == [("req-1", 2, invariant)]
    assert main([str(bad)]) == 1
    assert f"req-1 round 2: {invariant}:" in capsys.readouterr().out


def test_an_output_that_does_not_rebuild_is_reported(recorded: Any, tmp_path: Path, capsys: Any) -> None:
    log, _ = recorded

    def drop_last_streamed(record: dict[str, Any]) -> None:
        if record["event"] == "finish" and record["request_id"] == "req-1":
            record["token_ids"] = record["token_ids"][:-1]

    _, report = replay_json(str(edited(log, tmp_path / "short.jsonl", drop_last_streamed)), capsys=capsys)
    (finding,) = report["findings"]
    assert finding["request"] == "req-1" and finding["check"] == "output" and "max_tokens is 14" in finding["message"]


def test_rerun_on_the_unchanged_setup_reports_no_difference(recorded: Any, capsys: Any) -> None:
    log, streamed = recorded
    code, report = replay_json(str(log), "--rerun", capsys=capsys)
    assert code == 0
    assert [(r["request"], r["first_difference"]) for r in report["rerun"]] == [(k, None) for k in streamed]
    assert all(r["rerun_output"] == streamed[r["request"]] for r in report["rerun"])


def test_rerun_with_changed_drafter_weights_is_refused_unless_allowed_then_names_the_first_differing_round(
        tiny_llama_dir: Path, tmp_path: Path, capsys: Any) -> None:
    config = fixtures.drafter_config(fixtures.tiny_config("llama"), block_size=16)
    folder = fixtures.drafter_folder(tmp_path / "drafter", config, fixtures.drafter_weights(config))
    log = tmp_path / "run.jsonl"
    record(log, tiny_llama_dir, folder, [(PROMPTS[2], GenerationParams(max_tokens=10, block_size=4))])
    fixtures.drafter_folder(folder, config, fixtures.drafter_weights(config, seed=7, scale=0.5))  # same path

    with pytest.raises(ReplayError, match="drafter at .* is not the one that ran.*--allow-changed-weights"):
        main([str(log), "--rerun"])
    code = main([str(log), "--rerun", "--allow-changed-weights"])
    out = capsys.readouterr().out
    assert code == 1
    assert "req-0: first difference at round 0 (drafts" in out and "logged" in out and "rerun" in out
    code, report = replay_json(str(log), "--rerun", "--allow-changed-weights", capsys=capsys)
    diff = report["rerun"][0]["first_difference"]
    assert diff["round"] == 0 and "drafts" in diff["fields"] and diff["logged"]["drafts"] != diff["rerun"]["drafts"]


def test_rerun_refuses_a_random_drafter(tiny_llama_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "random.jsonl"
    record(log, tiny_llama_dir, "random:2", [(PROMPTS[0], GenerationParams(max_tokens=4, block_size=4))])
    assert main([str(log)]) == 0  # the replay itself needs no drafter
    with pytest.raises(ReplayError, match="random:L"):
        main([str(log), "--rerun"])


def _partial_overlaps(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Slices on one (pid, tid) that overlap without nesting: checked independently of the replay."""
    bad = []
    by_track: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for track, spans in by_track.items():
        for a0, a1 in spans:
            for b0, b1 in spans:
                if a0 < b0 < a1 < b1:
                    bad.append((track, (a0, a1), (b0, b1)))
    return bad


def test_the_trace_is_trace_event_json_with_a_track_per_actor_and_nested_slices(recorded: Any, tmp_path: Path, capsys: Any) -> None:
    log, _ = recorded
    out = tmp_path / "trace.json"
    assert main([str(log), "--trace", str(out)]) == 0
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert all(isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0 for e in slices)
    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(processes.values()) == ["request req-0", "request req-0#2", "request req-1"]
    threads = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(pid, actor) for pid in processes for actor in ("drafter", "verifier", "committer")} <= threads
    named = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in slices} <= named
    replay = read_log(log)
    assert len(slices) == 3 * sum(len(r.rounds) for r in replay.requests.values())
    assert _partial_overlaps(events) == [] and nesting_problems(trace) == []
    # pipelined: round N+1 is drafted before round N's verify is read, and the picture shows it
    pid = next(p for p, name in processes.items() if name == "request req-0")
    spans = {(e["name"], e["pid"]): (e["ts"], e["ts"] + e["dur"]) for e in slices}
    rounds = len(replay.requests["req-0"].rounds)
    assert any(spans[(f"draft {n + 1}", pid)][0] < spans[(f"verify {n}", pid)][1] for n in range(rounds - 1))


def test_partially_overlapping_verifies_go_on_a_second_verifier_track(recorded: Any, tmp_path: Path) -> None:
    log, _ = recorded
    rounds = {r.round: r for r in read_log(log).requests["req-0"].rounds}

    def queue_round3_before_round2_is_read(record: dict[str, Any]) -> None:
        if record["event"] == "round" and record["request_id"] == "req-0" and record["round"] == 3:
            r2 = rounds[2]
            record["verify_queued"] = (r2.verify_queued + r2.verify_ready) / 2
            record["draft_queued"] = min(record["draft_queued"], record["verify_queued"])

    out = tmp_path / "trace.json"
    main([str(edited(log, tmp_path / "overlap.jsonl", queue_round3_before_round2_is_read)), "--request", "req-0",
          "--trace", str(out)])
    events = json.loads(out.read_text())["traceEvents"]
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert "verifier (overlap 1)" in threads.values()
    assert _partial_overlaps(events) == []


def test_corrupt_and_truncated_lines_are_reported_by_number_and_the_rest_is_used(recorded: Any, tmp_path: Path, capsys: Any) -> None:
    log, _ = recorded
    lines = log.read_text().splitlines()
    rounds = json.loads(lines[2])
    assert rounds["event"] == "round"
    bad = lines[:3] + ["{not json", json.dumps({**rounds, "v": 2}), json.dumps({**rounds, "event": "gossip"})]
    bad += lines[3:]
    bad[-1] = bad[-1][: len(bad[-1]) // 2]  # the last record half-written, no newline
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(bad))
    code, report = replay_json(str(broken), capsys=capsys)
    assert code == 1
    problems = {p["line"]: p["message"] for p in report["problems"]}
    assert set(problems) == {4, 5, 6, len(bad)}
    assert problems[4].startswith("invalid JSON") and "schema version 2" in problems[5]
    assert "unknown record type 'gossip'" in problems[6] and "half-written last line" in problems[len(bad)]
    replay = read_log(broken)
    assert sum(len(r.rounds) for r in replay.requests.values()) == sum(len(r.rounds) for r in read_log(log).requests.values())
    last = list(replay.requests.values())[-1]
    assert last.finish is None  # its finish was the half-written line
    assert [f["check"] for f in report["findings"]] == ["finish"]  # everything else still audits clean


def test_discarded_rounds_are_summed_when_the_finish_records_log_them(recorded: Any, tmp_path: Path, capsys: Any) -> None:
    log, _ = recorded

    def one_discarded(record: dict[str, Any]) -> None:
        if record["event"] == "finish":
            record["discarded_rounds"] = 1

    _, report = replay_json(str(edited(log, tmp_path / "d.jsonl", one_discarded)), capsys=capsys)
    assert report["summary"]["discarded_rounds"] == 3


def test_the_command_line_replays_without_loading_mlx(recorded: Any) -> None:
    log, _ = recorded
    script = ("import sys; from runtime.replay.cli import main; code = main([sys.argv[1], '--rounds', '1:3']); "
              "assert not [m for m in sys.modules if m.startswith('mlx')], 'replay imported mlx'; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", script, str(log)], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=60)
    assert done.returncode == 0, done.stderr
    assert "rounds 1:3" in done.stdout and "every round passes" in done.stdout
    done = subprocess.run([sys.executable, "-m", "runtime.replay", str(log), "--request", "nope"],
                          capture_output=True, text=True, cwd=Path(__file__).parents[1], timeout=60)
    assert done.returncode == 2 and "request 'nope' is not in" in done.stderr


def _hand_made_request(bonus: int, token_ids: list[int], reason: str, stop: tuple[str, ...]) -> Any:
    """A consistent two-round request: prompt [1, 2], prefill token 7, rounds commit [8, 2, 9] and [bonus]."""
    from protocol import FinishRecord, ModelIdentity, RequestRecord, RoundRecord
    from runtime.replay.reading import RequestLog

    model = ModelIdentity("m", "/m", "huggingface", "0" * 64)
    request = RequestRecord(request_id="r", time=0.0, target=model, drafter=None, prompt_ids=[1, 2], seed=-1,
                            params=GenerationParams(max_tokens=8, block_size=4, stop=stop), mode="sequential",
                            block_size=4, n_taps=2, hidden_size=4)

    def round_record(n: int, kv: int, ctx: int, drafts: list[int], target: list[int], a: int) -> RoundRecord:
        return RoundRecord(request_id="r", time=0.0, round=n, anchor_pos=kv, block_size=4, drafts=drafts,
                           target_tokens=target, accepted=a, committed=drafts[:a] + [target[a]], target_kv_before=kv,
                           target_kv_after=kv + a + 1, drafter_ctx_before=ctx, drafter_ctx_after=kv, new_ctx_rows=a + 1,
                           tap_shape=[4, 8], greedy=True, speculative=False, draft_queued=n, draft_ready=None,
                           verify_queued=n + 0.1, verify_ready=n + 0.2, commit=n + 0.3)

    rounds = [round_record(0, 2, 0, [8, 2, 5], [8, 2, 9, 4], 2), round_record(1, 5, 2, [5, 5, 5], [bonus, 1, 1, 1], 0)]
    finish = FinishRecord(request_id="r", time=0.0, finish_reason=reason, token_ids=token_ids, text="", rounds=2)
    return RequestLog("r", request, rounds, finish)


@pytest.mark.parametrize("bonus,streamed,reason,stop,problem", [
    (6, [7, 8, 2, 9], "stop", (), None),  # EOS 6 cut, not streamed
    (8, [7, 8, 2, 9], "stop", (), "which was streamed earlier"),  # 8 cannot be the EOS: it was streamed
    (6, [7, 8, 2, 9, 6], "stop", (), "no committed token follows"),  # an EOS stop needs its EOS after the stream
    (6, [7, 8, 2, 9, 6], "stop", ("x",), None),  # a stop string may end on any token of the last round
    (6, [7, 8], "stop", (), "outside the last round's tokens"),  # ended in round 0, yet round 1 ran
    (6, [7, 8, 2, 9], "length", (), "max_tokens is 8"),
    (6, [7, 8, 2, 9, 6], "cancelled", (), None),
    (6, [7, 8], "cancelled", (), "cancelled after streaming 2 of 5"),
    (6, [7, 8, 3], "stop", (), "output token 2: rebuilt 2, streamed 3"),
])
def test_the_stream_cut_must_be_the_one_its_finish_reason_makes(bonus: int, streamed: list[int], reason: str,
                                                                 stop: tuple[str, ...], problem: str | None) -> None:
    messages = [f.message for f in audit_request(_hand_made_request(bonus, streamed, reason, stop))]
    assert messages == ([] if problem is None else [m for m in messages if problem in m]) and len(messages) <= 1
    assert bool(messages) == (problem is not None)
