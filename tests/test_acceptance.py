"""The accept logic, property-tested, and sampling shown lossless by a statistical test."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import mlx.core as mx
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

from protocol import GenerationParams
from runtime.acceptance import greedy_verdict, sampled_verdict
from runtime.loading import load_drafter, load_target
from runtime.sampling import Sampler, probabilities
from runtime.speculative import SpeculativeDecoder
from runtime.stopping import TextStream

from . import fixtures

VOCAB = 12


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_greedy_verdict_accepts_exactly_the_matching_prefix(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 15))
    target = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n + 1, max_size=n + 1))
    drafts = [t if data.draw(st.booleans()) else data.draw(st.integers(0, VOCAB - 1)) for t in target[:n]]
    logits = mx.array(np.eye(VOCAB, dtype=np.float32)[target] * 5.0)
    result = greedy_verdict(mx.array(drafts, dtype=mx.int32), logits)
    a = next((i for i in range(n) if drafts[i] != target[i]), n)
    assert int(result.accepted.item()) == a
    assert int(result.bonus.item()) == target[a]
    assert result.target_tokens.tolist() == target


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_sampled_verdict_commits_accepted_drafts_then_a_token_other_than_the_rejected(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 8))
    drafts = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    logits = mx.array(rng.standard_normal((n + 1, VOCAB)).astype(np.float32) * 2)
    params = GenerationParams(temperature=1.0, seed=data.draw(st.integers(0, 1000)))
    result = sampled_verdict(mx.array(drafts, dtype=mx.int32), logits, params, Sampler(params))
    a, bonus = int(result.accepted.item()), int(result.bonus.item())
    assert 0 <= a <= n
    assert result.target_tokens.tolist()[:a] == drafts[:a]
    assert result.target_tokens.tolist()[a] == bonus
    if a < n:
        assert bonus != drafts[a]  # p with the rejected draft removed


@settings(max_examples=100, deadline=None)
@given(committed=st.lists(st.lists(st.integers(3, 300), min_size=1, max_size=8), min_size=1, max_size=10),
       stop_at=st.integers(0, 60), max_tokens=st.integers(1, 60))
def test_stop_tokens_and_limits_cut_committed_groups_like_one_token_at_a_time(tiny_llama, committed, stop_at, max_tokens) -> None:  # type: ignore[no-untyped-def]
    flat = [t for group in committed for t in group]
    eos = next(iter(tiny_llama.tokenizer.eos_token_ids))
    if stop_at < len(flat):
        flat[stop_at] = eos
    groups, i = [], 0
    for g in committed:
        groups.append(flat[i : i + len(g)])
        i += len(g)
    grouped, single = TextStream(tiny_llama.tokenizer, max_tokens), TextStream(tiny_llama.tokenizer, max_tokens)
    text_g = "".join(grouped.push(g).text for g in groups if grouped.finish_reason is None)
    text_s = "".join(single.push([t]).text for t in flat if single.finish_reason is None)
    assert grouped.token_ids == single.token_ids
    assert text_g == text_s
    assert eos not in grouped.token_ids and len(grouped.token_ids) <= max_tokens


# ------------------------------------------------------------------ lossless sampling

SAMPLES = 2500
GENERATED = 4
FALSE_ALARM = 1e-3  # overall, Bonferroni-split over the tests below


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A 1-layer target with a 12-token vocabulary, so random drafts are often accepted."""
    config = fixtures.tiny_config("llama", vocab_size=VOCAB, num_hidden_layers=3, hidden_size=32,
                                  intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    folder = tmp_path_factory.mktemp("smallvocab")
    weights = fixtures.random_weights(config, seed=2, scale=0.3)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    fixtures.save_safetensors(folder, weights)
    _byte_tokenizer(folder)
    target = load_target(folder, dtype="float32")
    dconfig = fixtures.drafter_config(config, layers=1, block_size=4, taps=[0, 2], mask_token_id=1)
    dconfig.update(head_dim=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=32)
    drafter = load_drafter(fixtures.drafter_folder(folder / "drafter", dconfig, fixtures.drafter_weights(dconfig)), target)
    return target, drafter


def _byte_tokenizer(folder: Path) -> None:
    """A 12-entry word-level tokenizer (no byte alphabet fits in 12 tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))


def exact_plain_distribution(target, prompt: list[int], params: GenerationParams) -> np.ndarray:  # type: ignore[no-untyped-def]
    """P(t1..tk) of plain sampling, enumerated over every sequence in one batched forward."""
    seqs = np.array(list(itertools.product(range(VOCAB), repeat=GENERATED)))
    tokens = mx.array(np.concatenate([np.tile(prompt, (len(seqs), 1)), seqs], axis=1))
    logits = target.model(tokens).logits[:, len(prompt) - 1 : -1]
    probs = np.array(probabilities(logits, params))
    step = np.take_along_axis(probs, seqs[..., None], axis=-1)[..., 0]
    return step.prod(axis=1)


def dflash_samples(target, drafter, prompt: list[int], params: GenerationParams) -> np.ndarray:  # type: ignore[no-untyped-def]
    out = np.zeros(VOCAB**GENERATED)
    for seed in range(SAMPLES):
        request = msgspec.structs.replace(params, max_tokens=GENERATED, seed=seed, block_size=4)
        decoder = SpeculativeDecoder(target.model, drafter, request)
        state, first = decoder.prefill(prompt)
        tokens, index = [first], 0
        while len(tokens) < GENERATED:
            tokens += decoder.round(state, index).facts.committed
            index += 1
        out[int(np.ravel_multi_index(tokens[:GENERATED], (VOCAB,) * GENERATED))] += 1
    return out


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit, pooling cells with expected count < 5 into one."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    exp *= obs.sum() / exp.sum()
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_p=0.9, top_k=6)])
def test_dflash_sampling_matches_the_targets_distribution(small_vocab_pair, sampling) -> None:  # type: ignore[no-untyped-def]
    """Chi-square on the joint of the first 4 tokens; false alarm 1e-3 per parameter set / 2."""
    target, drafter = small_vocab_pair
    params = GenerationParams(**sampling)
    prompt = [3, 7, 1]
    exact = exact_plain_distribution(target, prompt, params)
    counts = dflash_samples(target, drafter, prompt, params)
    assert chi_square_pvalue(counts, exact) > FALSE_ALARM / 2
