"""The bundled SmolLM2-135M drafter, on the real default target, on the CPU.

tests/data/heldout_math_prompts.jsonl was written by hand for this test, so no training
run has seen it. The drafter must draft usefully (tau above 2) and exactly: every
output equals plain greedy decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest

from protocol import GenerationParams
from runtime.bench import read_prompts, run_dflash, run_plain
from runtime.defaults import default_drafter_path
from runtime.loading import LoadedModel, load_drafter

PROMPTS = Path(__file__).parent / "data" / "heldout_math_prompts.jsonl"
MIN_TAU = 2.0


def test_bundled_drafter_fits_the_size_limit_and_unpacks_to_a_z_lab_folder(tmp_path: Path) -> None:
    from runtime.training.pack import unpack_drafter

    path = default_drafter_path()
    assert path is not None, "the checkout must bundle runtime/drafters/smollm2-135m-dflash"
    assert (path / "model.safetensors").stat().st_size <= 25 * 1024 * 1024
    unpack_drafter(path, tmp_path / "z-lab")  # packed in 8 bits to fit; z-lab's loader reads the unpacked form
    config = json.loads((tmp_path / "z-lab" / "config.json").read_text())
    assert "quantization" not in config and config["architectures"] == ["DFlashDraftModel"]
    weights = mx.load(str(tmp_path / "z-lab" / "model.safetensors"))
    assert weights["fc.weight"].shape == (config["hidden_size"], config["hidden_size"] * len(
        config["dflash_config"]["target_layer_ids"]))
    assert not any(name.endswith((".scales", ".biases")) for name in weights)


@pytest.mark.slow
def test_bundled_drafter_drafts_exactly_with_tau_above_two_on_heldout_math(smollm2: LoadedModel) -> None:
    path = default_drafter_path()
    if path is None:
        pytest.fail("no bundled drafter")
    drafter = load_drafter(path, smollm2)
    delivered, rounds = 0, 0
    for _, ids in read_prompts(PROMPTS, smollm2):
        params = GenerationParams(max_tokens=64)
        result, stats = run_dflash(smollm2, drafter, ids, params)
        assert result.token_ids == run_plain(smollm2, ids, params).token_ids
        if result.finish_reason == "length":  # tau counts what was streamed (an EOS mid-round ends it sooner)
            assert sum(r.delivered for r in stats.rounds) == len(result.token_ids) - 1
        delivered += sum(r.delivered for r in stats.rounds)
        rounds += len(stats.rounds)
    assert delivered / rounds > MIN_TAU


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sequential", "pipelined", "pipelined2", "draft-ahead"])
def test_every_engine_mode_plays_the_reference_loops_rounds(smollm2: LoadedModel, mode: str, tmp_path: Path) -> None:
    """The same drafts, verdicts and positions every round, in every mode, up to the last round.

    max_tokens 45 ends mid-block, where only the sequential mode knows how many tokens the
    rounds in flight commit: a mode that shrank its last blocks to what remains would draft
    them differently (and accept a different number). The trained drafter accepts many per
    round, so a mode that attended positions past the valid context would draft differently too.
    """
    import anyio

    from protocol import RoundRecord, records
    from runtime.engine import Engine
    from runtime.invariants import RECORDED_FACTS, recorded_facts
    from runtime.replay.reading import RoundWindow, read_log
    from runtime.replay.summary import summarize

    path = default_drafter_path()
    assert path is not None
    drafter = load_drafter(path, smollm2)
    prompts = [ids for _, ids in read_prompts(PROMPTS, smollm2)]
    params = GenerationParams(max_tokens=45)
    reference = [run_dflash(smollm2, drafter, ids, params)[1] for ids in prompts]
    want = [[recorded_facts(r.facts) for r in stats.rounds] for stats in reference]
    assert sum(r["accepted"] for rounds in want for r in rounds) > sum(map(len, want)), "too few accepted to test"

    async def main() -> list[float]:
        taus = []
        async with Engine(smollm2, drafter, mode=mode, log=tmp_path / "rounds.jsonl") as engine:
            for ids in prompts:
                async for event in engine.generate(ids, params):
                    pass
                taus.append(float(event.stats["tau"]))
        return taus

    taus = anyio.run(main)
    logged = [records.from_json(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    by_request: dict[str, list[dict[str, object]]] = {}
    for record in logged:
        if isinstance(record, RoundRecord):
            by_request.setdefault(record.request_id, []).append({name: getattr(record, name) for name in RECORDED_FACTS})
    assert list(by_request.values()) == want
    # tau counts the tokens each round delivered, in the reference loop, the engine and the replay alike
    assert taus == pytest.approx([float(stats.summary(16)["tau"]) for stats in reference])
    replayed = summarize(list(read_log(tmp_path / "rounds.jsonl").requests.values()), RoundWindow())
    assert replayed.tau_mean == pytest.approx(sum(t * len(w) for t, w in zip(taus, want)) / sum(map(len, want)))


@pytest.mark.slow
@pytest.mark.parametrize("pad", [False, True])
def test_batched_requests_on_the_real_model_equal_plain_greedy(smollm2: LoadedModel, pad: bool) -> None:
    """The engine batches these concurrent requests into shared forwards; each output stays the target's own."""
    import anyio

    from runtime.engine import Engine

    path = default_drafter_path()
    assert path is not None
    drafter = load_drafter(path, smollm2)
    prompts = [ids for _, ids in read_prompts(PROMPTS, smollm2)]
    params = GenerationParams(max_tokens=32)

    async def main() -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        async with Engine(smollm2, drafter, pad_batches=pad) as engine:
            async def one(i: int) -> None:
                out[i] = [t async for e in engine.generate(prompts[i], params) for t in e.token_ids]

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
        return out

    got = anyio.run(main)
    for i, ids in enumerate(prompts):
        assert got[i] == run_plain(smollm2, ids, params).token_ids, i


@pytest.mark.slow
def test_four_blocks_a_round_raise_tau_on_the_real_model_and_keep_plain_greedy_output(smollm2: LoadedModel) -> None:
    """runtime/branches.py on the trained drafter, batched in the pipelined engine: more tokens a
    round than with one block, and the same output as plain greedy."""
    import anyio

    from runtime.bench import EngineGroup, run_together

    path = default_drafter_path()
    assert path is not None
    drafter = load_drafter(path, smollm2)
    prompts = [ids for _, ids in read_prompts(PROMPTS, smollm2)]
    params = GenerationParams(max_tokens=64)
    want = [run_plain(smollm2, ids, params).token_ids for ids in prompts]

    def tau(group: EngineGroup) -> float:
        rounds = [int(e.stats["rounds"]) for _, e in group.results]
        return sum(float(e.stats["tau"]) * n for (_, e), n in zip(group.results, rounds)) / sum(rounds)

    one = anyio.run(run_together, smollm2, drafter, prompts, params, "pipelined", None, 1)
    four = anyio.run(run_together, smollm2, drafter, prompts, params, "pipelined", None, 4)
    assert [t for t, _ in one.results] == want and [t for t, _ in four.results] == want
    assert tau(four) > tau(one) + 0.2
