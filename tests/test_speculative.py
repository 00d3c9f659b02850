"""DFlash decoding is exact: greedy output equals plain greedy, token for token."""

from __future__ import annotations

import copy
import dataclasses
import random

import mlx.core as mx
import pytest

from protocol import GenerationParams
from runtime.errors import RequestError
from runtime.invariants import (AcceptanceViolation, LagViolation, LayoutViolation, RollbackViolation,
                                RoundAuditor, TrimViolation)
from runtime.loading import LoadedModel
from runtime.models.dflash import DFlashDrafter, Proposal
from runtime.plain import generate_plain, run_to_end
from runtime.speculative import RequestState, SpeculativeDecoder, SpeculativeStats, generate_speculative
from runtime.stopping import TextStream

PROMPTS = [[random.Random(i).randrange(3, 320) for _ in range(random.Random(i).randrange(1, 30))] for i in range(12)]


def plain(target: LoadedModel, prompt: list[int], params: GenerationParams) -> list[int]:
    return run_to_end(generate_plain(target.model, target.tokenizer, prompt, params), len(prompt)).token_ids


def speculative(target: LoadedModel, drafter: DFlashDrafter, prompt: list[int], params: GenerationParams,
                stats: SpeculativeStats | None = None) -> list[int]:
    emissions = generate_speculative(target.model, drafter, target.tokenizer, prompt, params, stats)
    return run_to_end(emissions, len(prompt)).token_ids


@pytest.mark.parametrize("block", [2, 3, 4, 7, 8, 16])
def test_greedy_speculative_output_equals_plain_greedy(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, block: int) -> None:
    for i, prompt in enumerate(PROMPTS):
        params = GenerationParams(max_tokens=9 + 5 * i, block_size=block)  # limits fall mid-block
        assert speculative(tiny_llama, tiny_drafter, prompt, params) == plain(tiny_llama, prompt, params)


class NoisyOracleDecoder(SpeculativeDecoder):
    """The real drafter runs (its context and cache are real); its proposals are replaced by
    the known greedy continuation with random corruptions, so every accept length occurs."""

    def __init__(self, *args, continuation: list[int], corruption: float, seed: int, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.continuation, self.corruption, self.rng = continuation, corruption, random.Random(seed)

    def draft(self, state: RequestState, block: int) -> Proposal:
        super().draft(state, block)
        start = state.committed - self.prompt_len
        want = self.continuation[start : start + block - 1]
        drafts = [t if self.rng.random() > self.corruption else (t + 1) % 320 for t in want]
        drafts += [7] * (block - 1 - len(drafts))
        return Proposal(mx.array([[drafts]], dtype=mx.int32), None)


def run_decoder(decoder: SpeculativeDecoder, target: LoadedModel, prompt: list[int], params: GenerationParams) -> tuple[list[int], list[int]]:
    stream = TextStream(target.tokenizer, params.max_tokens, params.stop)
    state, first = decoder.prefill(prompt)
    emission, accepted, index = stream.push([first]), [], 0
    while emission.finish_reason is None:
        outcome = decoder.round(state, index)
        accepted.append(outcome.facts.accepted)
        emission = stream.push(outcome.facts.committed)
        index += 1
    return stream.token_ids, accepted


@pytest.mark.parametrize("corruption", [0.0, 0.15, 0.5])
def test_every_accept_length_commits_exactly_the_verifiers_tokens(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter, corruption: float) -> None:
    seen: set[int] = set()
    for i, prompt in enumerate(PROMPTS[:6]):
        params = GenerationParams(max_tokens=40 + i, block_size=8)
        want = plain(tiny_llama, prompt, params)
        decoder = NoisyOracleDecoder(tiny_llama.model, tiny_drafter, params, continuation=want, corruption=corruption, seed=i)
        decoder.prompt_len = len(prompt)
        got, accepted = run_decoder(decoder, tiny_llama, prompt, params)
        assert got == want
        seen.update(accepted)
    if corruption == 0.0:
        assert 7 in seen  # full blocks accepted
    if corruption == 0.15:
        assert len(seen) >= 5


def test_every_committed_token_is_the_argmax_of_a_fresh_full_forward(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    prompt = PROMPTS[3]
    out = speculative(tiny_llama, tiny_drafter, prompt, GenerationParams(max_tokens=30, block_size=5))
    logits = tiny_llama.model(mx.array([prompt + out])).logits[0]
    fresh = mx.argmax(logits[len(prompt) - 1 : -1], axis=-1).tolist()
    assert out == fresh


def test_eos_falling_mid_block_ends_like_plain_decoding(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    prompt = PROMPTS[5]
    free = plain(tiny_llama, prompt, GenerationParams(max_tokens=30))
    eos = next(t for t in free[3:] if t not in free[:3])  # first occurrence well inside the output
    target = dataclasses.replace(tiny_llama, tokenizer=copy.copy(tiny_llama.tokenizer))
    target.tokenizer.eos_token_ids = frozenset({eos})
    for block in (4, 16):
        params = GenerationParams(max_tokens=30, block_size=block)
        got = run_to_end(generate_speculative(target.model, tiny_drafter, target.tokenizer, prompt, params), len(prompt))
        assert got.token_ids == free[: free.index(eos)]
        assert got.finish_reason == "stop"


def test_block_size_beyond_the_drafters_is_refused_by_field(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    with pytest.raises(RequestError, match="block_size"):
        speculative(tiny_llama, tiny_drafter, PROMPTS[0], GenerationParams(max_tokens=4, block_size=17))


def test_stats_report_rounds_tau_and_per_position_acceptance(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter) -> None:
    stats = SpeculativeStats()
    out = speculative(tiny_llama, tiny_drafter, PROMPTS[1], GenerationParams(max_tokens=20, block_size=4), stats)
    summary = stats.summary(4)
    assert summary["rounds"] == len(stats.rounds)
    assert sum(r.facts.accepted + 1 for r in stats.rounds) >= len(out) - 1
    assert len(summary["acceptance_per_position"]) == 3


# ------------------------------------------------------------------ invariants


@pytest.fixture
def real_round(tiny_llama: LoadedModel, tiny_drafter: DFlashDrafter):  # type: ignore[no-untyped-def]
    decoder = SpeculativeDecoder(tiny_llama.model, tiny_drafter, GenerationParams(max_tokens=20, block_size=6))
    state, _ = decoder.prefill(PROMPTS[2])
    return decoder, state, decoder.round(state, 0).facts


def broken(facts, **changes):  # type: ignore[no-untyped-def]
    return dataclasses.replace(facts, **changes)


def test_each_invariant_broken_in_a_round_record_raises_its_named_error(real_round) -> None:  # type: ignore[no-untyped-def]
    decoder, _, facts = real_round

    def check(f):  # type: ignore[no-untyped-def]
        RoundAuditor(len(PROMPTS[2]), len(decoder.drafter.tap_layers), decoder.target.args.hidden_size).check(f)

    check(facts)  # the real round passes
    cases = [
        (LagViolation, broken(facts, target_kv_before=facts.target_kv_before + 1, anchor_pos=facts.anchor_pos + 1)),
        (TrimViolation, broken(facts, new_ctx_rows=facts.new_ctx_rows + 1)),
        (TrimViolation, broken(facts, target_kv_after=facts.target_kv_after + 2)),
        (RollbackViolation, broken(facts, drafter_ctx_after=facts.drafter_ctx_before - 1)),
        (LayoutViolation, broken(facts, tap_shape=(facts.tap_shape[1], facts.tap_shape[0]))),
        (AcceptanceViolation, broken(facts, committed=facts.committed + [1])),
    ]
    for error, facts_ in cases:
        with pytest.raises(error) as info:
            check(facts_)
        assert info.value.state["round"] == 0


def test_a_cache_not_trimmed_is_caught_as_a_lag_violation_next_round(real_round) -> None:  # type: ignore[no-untyped-def]
    decoder, state, _ = real_round
    state.target_cache[0].offset += 1
    for c in state.target_cache[1:]:
        c.offset += 1
    with pytest.raises(LagViolation):
        decoder.round(state, 1)


def test_a_rolled_back_drafter_cache_is_caught(real_round) -> None:  # type: ignore[no-untyped-def]
    decoder, state, _ = real_round
    for c in state.drafter_cache:
        c.trim(2)
    with pytest.raises(RollbackViolation):
        decoder.round(state, 1)


def test_invariant_checks_survive_python_dash_o() -> None:
    import subprocess
    import sys

    code = ("from runtime.invariants import *\n"
            "f = RoundFacts(0, 5, 2, [1], [1, 2], 1, [1, 2], 5, 5, 6, 0, 4, 2, (2, 8))\n"
            "try:\n    RoundAuditor(4, 1, 8).check(f)\nexcept LagViolation:\n    print('caught')\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "caught"
