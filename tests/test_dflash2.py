"""DFlash 2 drafters (z-lab's ``DFlash2DraftModel``): loading, checkpoint errors, exact decoding.

Parity of the forward and the selector with z-lab's own MLX code is in test_dflash2_parity.py
(a side environment); these run everywhere: a DFlash 2 drafter's greedy output equals plain
greedy in every engine mode and in the reference loop, seeded sampling agrees across modes,
and rejection sampling with the selector's q keeps the target's distribution.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chisquare

from protocol import GenerationParams
from runtime.acceptance import sampled_verdict
from runtime.drafters import random_drafter, resolve_drafter
from runtime.engine import MODES, Engine
from runtime.errors import CheckpointError
from runtime.loading import LoadedModel, load_drafter
from runtime.models.dflash import ConvDrafterLayer, DFlashDrafter
from runtime.sampling import Sampler, probabilities

from . import fixtures
from .test_acceptance import (  # noqa: F401
    FALSE_ALARM,
    chi_square_pvalue,
    dflash_samples,
    exact_plain_distribution,
    small_vocab_pair,
)
from .test_engine import PROMPTS, _run_concurrently, collect, plain, run
from .test_speculative import speculative


@pytest.fixture(scope="module")
def random2(tiny_llama: LoadedModel) -> DFlashDrafter:
    return resolve_drafter("random:2:dflash2", tiny_llama, block_size=8)


@pytest.fixture(scope="module")
def dflash2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = fixtures.dflash2_config(fixtures.tiny_config("llama"))
    return fixtures.drafter_folder(tmp_path_factory.mktemp("dflash2"), config, fixtures.dflash2_weights(config))


def test_random_dflash2_spec_builds_the_convolutions_and_the_selector(random2: DFlashDrafter, tiny_llama: LoadedModel) -> None:
    assert random2.selector is not None and all(isinstance(layer, ConvDrafterLayer) for layer in random2.layers)
    assert random2.block_size == 8
    with pytest.raises(CheckpointError, match="random:L:dflash2"):
        resolve_drafter("random:2:dflash3", tiny_llama)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_dflash2_greedy_output_equals_plain_greedy_in_every_mode(tiny_llama: LoadedModel, random2: DFlashDrafter, mode: str) -> None:
    params = [GenerationParams(max_tokens=7 + 3 * i, block_size=2 + i % 7) for i in range(6)]
    want = [plain(tiny_llama, p, q) for p, q in zip(PROMPTS, params)]

    async def alone() -> list[list[int]]:
        async with Engine(tiny_llama, random2, mode=mode) as engine:
            return [(await collect(engine, p, q))[0] for p, q in zip(PROMPTS, params)]

    assert run(alone) == want
    together = run(_run_concurrently(Engine(tiny_llama, random2, mode=mode, pad_batches=True), PROMPTS[:6], params))
    assert [together[i] for i in range(6)] == want


def test_dflash2_reference_loop_greedy_equals_plain_greedy(tiny_llama: LoadedModel, random2: DFlashDrafter) -> None:
    for i, prompt in enumerate(PROMPTS[:6]):
        params = GenerationParams(max_tokens=9 + 5 * i, block_size=2 + i)
        assert speculative(tiny_llama, random2, prompt, params) == plain(tiny_llama, prompt, params)


def test_dflash2_seeded_sampling_is_the_same_in_every_mode_and_in_a_batch(tiny_llama: LoadedModel, random2: DFlashDrafter) -> None:
    params = [GenerationParams(max_tokens=20, temperature=1.3, seed=i, block_size=3 + i % 4) for i in range(4)]

    async def outputs(mode: str) -> list[list[int]]:
        async with Engine(tiny_llama, random2, mode=mode) as engine:
            return [(await collect(engine, p, q))[0] for p, q in zip(PROMPTS, params)]

    sequential = run(lambda: outputs("sequential"))
    for mode in sorted(MODES):
        assert run(lambda mode=mode: outputs(mode)) == sequential, mode
    greedy = [GenerationParams(max_tokens=12, block_size=5)] * 2
    together = run(_run_concurrently(Engine(tiny_llama, random2, pad_batches=True), PROMPTS[:6], params + greedy))
    assert [together[i] for i in range(4)] == sequential


def test_a_dflash2_checkpoint_loads_and_decodes_exactly(tiny_llama: LoadedModel, dflash2_dir: Path) -> None:
    drafter = load_drafter(dflash2_dir, tiny_llama)
    assert drafter.selector is not None and drafter.selector.top_k == 6
    stored = mx.load(str(dflash2_dir / "model.safetensors"))["candidate_selector.successor_codebook"]
    assert mx.array_equal(drafter.selector.successor_codebook.weight, stored.astype(mx.float32))
    for i, prompt in enumerate(PROMPTS[:3]):
        params = GenerationParams(max_tokens=12 + i, block_size=8)
        assert speculative(tiny_llama, drafter, prompt, params) == plain(tiny_llama, prompt, params)


def _broken_copy(source: Path, folder: Path, tensors: Any = None, config: Any = None) -> Path:
    folder.mkdir()
    weights = mx.load(str(source / "model.safetensors"))
    cfg = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), tensors(weights) if tensors else weights)
    return folder


@pytest.mark.parametrize("damage,named", [
    ("missing_codebook", "candidate_selector.predecessor_codebook"),
    ("misshaped_conv_kernel", "layers.1.attention_conv.base_kernel"),
    ("misshaped_kernel_projection", "layers.0.mlp_conv.kernel_projection.weight"),
    ("missing_config_field", "conv_kernel_size"),
    ("group_not_dividing", "conv_group_size"),
])
def test_a_broken_dflash2_checkpoint_names_what_is_wrong(tiny_llama: LoadedModel, dflash2_dir: Path, tmp_path: Path,
                                                          damage: str, named: str) -> None:
    def without(name: str) -> Any:
        return lambda w: {k: v for k, v in w.items() if k != name}

    def reshaped(name: str) -> Any:
        return lambda w: {**w, name: w[name][..., :-1]}

    def dflash_field(**changes: Any) -> Any:
        return lambda c: {**c, "dflash_config": {k: v for k, v in {**c["dflash_config"], **changes}.items() if v is not None}}

    damages = {
        "missing_codebook": dict(tensors=without("candidate_selector.predecessor_codebook")),
        "misshaped_conv_kernel": dict(tensors=reshaped("layers.1.attention_conv.base_kernel")),
        "misshaped_kernel_projection": dict(tensors=reshaped("layers.0.mlp_conv.kernel_projection.weight")),
        "missing_config_field": dict(config=dflash_field(conv_kernel_size=None)),
        "group_not_dividing": dict(config=dflash_field(conv_group_size=24)),
    }
    folder = _broken_copy(dflash2_dir, tmp_path / damage, **damages[damage])
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")):
        load_drafter(folder, tiny_llama)


def test_a_dflash1_checkpoint_still_loads_without_selector(tiny_drafter: DFlashDrafter) -> None:
    assert tiny_drafter.selector is None and not any(isinstance(layer, ConvDrafterLayer) for layer in tiny_drafter.layers)


def test_rejection_sampling_with_the_selectors_q_keeps_the_targets_distribution() -> None:
    """Drafts drawn from a q with zeros (a top-k): each committed position is distributed as p."""
    rng = np.random.default_rng(0)
    vocab, trials = 6, 4000
    logits = mx.array(rng.standard_normal((3, vocab)).astype(np.float32) * 1.5)
    params = GenerationParams(temperature=1.0, seed=5)
    p = np.array(probabilities(logits, params))
    q = np.zeros((2, vocab), np.float32)
    q[0, [0, 2, 3]] = [0.5, 0.3, 0.2]
    q[1, [1, 4, 5, 2]] = [0.4, 0.3, 0.2, 0.1]
    sampler = Sampler(params)
    firsts, seconds, accepted = np.zeros(vocab), np.zeros(vocab), 0
    for _ in range(trials):
        drafts = [int(rng.choice(vocab, p=q[i])) for i in range(2)]
        result = sampled_verdict(mx.array(drafts, dtype=mx.int32), logits, params, sampler, mx.array(q))
        committed = drafts[: int(result.accepted.item())] + [int(result.bonus.item())]
        accepted += int(result.accepted.item()) > 0
        firsts[committed[0]] += 1
        if len(committed) > 1:
            seconds[committed[1]] += 1
    for counts, want in ((firsts, p[0]), (seconds, p[1])):
        expected = want.astype(np.float64) / want.astype(np.float64).sum() * counts.sum()
        assert chisquare(counts, expected).pvalue > FALSE_ALARM
    # q is used: a draft is accepted with probability sum min(p, q), not sum p*q as with a one-hot q
    rate, spread = np.minimum(p[0], q[0]).sum(), 4 * np.sqrt(0.25 / trials)
    assert abs(accepted / trials - rate) < spread < abs((p[0] * q[0]).sum() - rate)


def test_the_drafts_stream_is_apart_from_the_verifiers() -> None:
    params = GenerationParams(temperature=1.0, seed=3)
    verifier, drafts = Sampler(params), Sampler(params, drafts=True)
    keys = {tuple(np.array(verifier.next_key()).tolist()) for _ in range(64)}
    assert not keys & {tuple(np.array(drafts.next_key()).tolist()) for _ in range(64)}
    again = Sampler(params, drafts=True)
    assert mx.array_equal(again.gumbel((3, 4)), Sampler(params, drafts=True).gumbel((3, 4)))  # seeded: reproducible


@pytest.mark.slow
def test_dflash2_sampling_matches_the_targets_distribution(small_vocab_pair) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """test_acceptance's chi-square on the first 4 tokens, with a DFlash 2 drafter whose top-8 q leaves 4 of 12 tokens out."""
    target, _ = small_vocab_pair
    drafter = random_drafter(target, layers=1, block_size=4, dflash2=True)
    assert drafter.selector is not None and drafter.selector.top_k < target.model.args.vocab_size
    params = GenerationParams(temperature=1.0)
    prompt = [3, 7, 1]
    counts = dflash_samples(target, drafter, prompt, params)
    assert chi_square_pvalue(counts, exact_plain_distribution(target, prompt, params)) > FALSE_ALARM / 2
