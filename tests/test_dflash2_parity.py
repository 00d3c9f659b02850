"""Parity with z-lab's own MLX ``DFlash2DraftModel`` (PyPI ``dflash==0.1.0``, ``dflash/model_mlx.py``).

Skips where ``dflash`` or ``mlx_lm`` is missing (CI, this project's venv): z-lab's module imports
``mlx_lm`` and ``huggingface_hub`` at module level. To run it (Linux, CPU; versions used):
    python3 -m venv /tmp/dflash2env
    /tmp/dflash2env/bin/pip install "mlx[cpu]==0.32.4" "mlx-lm[cpu]==0.32.2" huggingface_hub==2.4.0
    /tmp/dflash2env/bin/pip install --no-deps dflash==0.1.0   # its deps (datasets, ...) are for its benchmarks
    /tmp/dflash2env/bin/pip install -e . pytest && /tmp/dflash2env/bin/python -m pytest tests/test_dflash2_parity.py
z-lab's classes write the random-weight checkpoint (tests/reference/dflash2_mlx_reference.py), z-lab's
``load_draft`` and our loader both read it, and on the same block and context features, in float32:
the hidden states and logits agree within 1e-4, the selector's greedy path is the same tokens, its
top-k candidates the same set, and at temperature > 0 its q rows agree within 1e-4.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("dflash.model_mlx")

from runtime.loading import LoadedModel, load_drafter, load_target  # noqa: E402
from runtime.models.dflash import DFlashDrafter  # noqa: E402

from . import fixtures  # noqa: E402
from .reference import dflash2_mlx_reference as ref  # noqa: E402

TOLERANCE = 1e-4
TARGET_LAYERS = 6
MASK = 500
BLOCK = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    config = fixtures.tiny_config("qwen3", vocab_size=512, num_hidden_layers=TARGET_LAYERS)
    folder = tmp_path_factory.mktemp("target")
    return load_target(fixtures.hf_folder(folder, config, fixtures.random_weights(config, seed=11)), dtype="float32")


@pytest.fixture(scope="module", params=[dict(seed=3), dict(seed=4, conv_kernel_size=4, conv_group_size=8, selector_top_k=10,
                                                            num_layers=3, selector_rank=16)],
                ids=["k3-g16-top6", "k4-g8-top10"])
def pair(request: pytest.FixtureRequest, target: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[DFlashDrafter, Any]:
    folder = ref.write_random_checkpoint(str(tmp_path_factory.mktemp("dflash2")), vocab=512, mask_token_id=MASK,
                                         num_target_layers=TARGET_LAYERS, target_layer_ids=(1, 4), block_size=BLOCK,
                                         **request.param)
    return load_drafter(folder, target), ref.load_reference(folder).bind(target.model)


def inputs(seed: int, ctx_rows: int, anchor: int) -> tuple[mx.array, mx.array]:
    ctx = np.random.default_rng(seed).standard_normal((1, ctx_rows, 2 * 64)).astype(np.float32)
    return mx.array([[anchor] + [MASK] * (BLOCK - 1)]), mx.array(ctx)


def max_diff(a: mx.array, b: mx.array) -> float:
    return float(np.abs(np.array(a, dtype=np.float64) - np.array(b, dtype=np.float64)).max())


def test_hidden_states_and_logits_match_zlab(pair: tuple[DFlashDrafter, Any]) -> None:
    ours, theirs = pair
    for seed, (rows, anchor) in enumerate([(7, 17), (1, 3), (12, 499)]):
        block, ctx = inputs(seed, rows, anchor)
        hidden = ours.hidden(block, ctx, ours.make_cache())
        want = theirs.hidden_states(block, ctx, theirs.make_cache())
        assert max_diff(hidden, want) < TOLERANCE
        assert max_diff(ours.logits(hidden), theirs.compute_logits(want)) < TOLERANCE


def test_greedy_path_and_candidates_match_zlab_propose(pair: tuple[DFlashDrafter, Any]) -> None:
    ours, theirs = pair
    assert ours.selector is not None
    differs_from_argmax = False
    for seed, (rows, anchor) in enumerate([(7, 17), (3, 40), (10, 250), (5, 7)]):
        block, ctx = inputs(seed, rows, anchor)
        path, candidates, q = theirs.propose(block, ctx, theirs.make_cache(), 0.0, logits_start=1)
        assert q is None
        hidden = ours.hidden(block, ctx, ours.make_cache())[:, 1:]
        proposal = ours.propose(hidden, block[:, 0])
        assert proposal.probs is None
        assert proposal.tokens.tolist() == path.tolist()
        selection = ours.selector.select(hidden, ours.logits(hidden), block[:, 0])
        assert np.array_equal(np.sort(np.array(selection.candidates), -1), np.sort(np.array(candidates), -1))
        differs_from_argmax |= proposal.tokens.tolist() != mx.argmax(ours.logits(hidden), -1).tolist()
    assert differs_from_argmax, "the codebooks never changed a draft: the test would not see a wrong selector"


def test_sampled_q_rows_match_zlab_propose(pair: tuple[DFlashDrafter, Any]) -> None:
    """z-lab samples its path; ours is steered onto the same path (noise on its tokens), and then
    each position's q over the top-k, given the same previous token, must be z-lab's."""
    ours, theirs = pair
    temperature = 0.8
    for seed in range(4):
        block, ctx = inputs(seed, 6, 20 + seed)
        mx.random.seed(seed)
        path, candidates, q = theirs.propose(block, ctx, theirs.make_cache(), temperature, logits_start=1)
        hidden = ours.hidden(block, ctx, ours.make_cache())[:, 1:]
        ours_candidates = ours.selector.select(hidden, ours.logits(hidden), block[:, 0]).candidates  # type: ignore[union-attr]
        noise = mx.where(ours_candidates == path[..., None], 1e4, 0.0)
        proposal = ours.propose(hidden, block[:, 0], mx.array([temperature]), noise)
        assert proposal.tokens.tolist() == path.tolist()
        assert proposal.probs is not None
        want = mx.put_along_axis(mx.zeros(proposal.probs.shape), candidates, q, axis=-1)
        assert max_diff(proposal.probs, want) < TOLERANCE
        assert max_diff(proposal.probs.sum(-1), mx.ones(path.shape)) < 1e-5


@pytest.mark.parametrize("cache", ["host", "device"])
def test_cached_rounds_match_zlab(pair: tuple[DFlashDrafter, Any], cache: str) -> None:
    """Rounds whose new context rows accumulate in the caches (host KV, or the engine's device KV)."""
    ours, theirs = pair
    our_cache = ours.make_cache() if cache == "host" else ours.make_device_cache()
    their_hidden_cache, their_propose_cache = theirs.make_cache(), theirs.make_cache()
    for seed, (rows, anchor) in enumerate([(9, 3), (2, 40), (5, 41), (1, 7)]):
        block, ctx = inputs(10 + seed, rows, anchor)
        hidden = ours.hidden(block, ctx, our_cache)
        assert max_diff(hidden, theirs.hidden_states(block, ctx, their_hidden_cache)) < TOLERANCE
        path, _, _ = theirs.propose(block, ctx, their_propose_cache, 0.0, logits_start=1)
        assert ours.propose(hidden[:, 1:], block[:, 0]).tokens.tolist() == path.tolist()
