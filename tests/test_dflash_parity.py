"""Parity with z-lab's official PyTorch DFlashDraftModel (PyPI ``dflash==0.1.0``).

Skips where PyTorch or dflash is missing (CI). To run it:
    python3 -m venv /tmp/dflashenv && /tmp/dflashenv/bin/pip install "dflash[local]==0.1.0" torch==2.13.0
    /tmp/dflashenv/bin/pip install -e ".[test]" && /tmp/dflashenv/bin/python -m pytest tests/test_dflash_parity.py
The official classes write the random-weight checkpoint (tests/reference/dflash_torch_reference.py),
our loader reads it, and both forwards must agree within 1e-4 in float32.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("dflash")

from runtime.loading import LoadedModel, load_drafter, load_target  # noqa: E402

from . import fixtures  # noqa: E402
from .reference import dflash_torch_reference as ref  # noqa: E402

TOLERANCE = 1e-4
TARGET_LAYERS = 6


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    config = fixtures.tiny_config("qwen3", vocab_size=512, num_hidden_layers=TARGET_LAYERS)
    folder = tmp_path_factory.mktemp("target")
    return load_target(fixtures.hf_folder(folder, config, fixtures.random_weights(config, seed=11)), dtype="float32")


VARIANTS = {
    "full": {},
    "sliding_causal": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
    "all_causal": {"is_causal": True},
    "window_bidirectional": {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 3, "is_causal": False},
    "legacy_config": {"legacy_config": True},
    "bf16_weights": {"dtype": "bfloat16"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_drafter_matches_official_torch_model(tmp_path: Path, target: LoadedModel, variant: str) -> None:
    folder = ref.write_random_checkpoint(str(tmp_path / variant), vocab=512, mask_token_id=500,
                                         num_target_layers=TARGET_LAYERS, target_layer_ids=(1, 4), seed=3,
                                         **VARIANTS[variant])
    drafter = load_drafter(folder, target)
    rng = np.random.default_rng(0)
    ctx_len, block = 7, 8
    ctx = rng.standard_normal((ctx_len, 2 * 64)).astype(np.float32)
    tokens = [17] + [500] * (block - 1)
    hidden = drafter.hidden(mx.array([tokens]), mx.array(ctx[None]), drafter.make_cache())
    noise = np.array(target.model.embed(mx.array(tokens)))
    want = ref.reference_drafter_hidden(folder, noise, ctx, np.arange(ctx_len + block))
    assert np.abs(np.array(hidden) - want).max() < TOLERANCE
    head = np.array(target.model.model.embed_tokens.weight if target.model.args.tie_word_embeddings else target.model.lm_head.weight)
    logits = np.array(drafter.logits(hidden))
    assert np.abs(logits - ref.reference_logits(want[0], head)).max() < TOLERANCE


def test_cached_rounds_match_official_decode_loop_driving(tmp_path: Path, target: LoadedModel) -> None:
    folder = ref.write_random_checkpoint(str(tmp_path / "rounds"), vocab=512, mask_token_id=500,
                                         num_target_layers=TARGET_LAYERS, target_layer_ids=(1, 4), seed=5)
    drafter = load_drafter(folder, target)
    cache = drafter.make_cache()
    rng = np.random.default_rng(1)
    rounds, ours, start = [], [], 0
    for new_rows, anchor in ((9, 3), (2, 40), (5, 41), (1, 7)):
        ctx = rng.standard_normal((new_rows, 128)).astype(np.float32)
        start += new_rows
        tokens = [anchor] + [500] * 7
        ours.append(np.array(drafter.hidden(mx.array([tokens]), mx.array(ctx[None]), cache)))
        rounds.append((np.array(target.model.embed(mx.array(tokens))), ctx, start))
    for got, want in zip(ours, ref.reference_drafter_rounds(folder, rounds)):
        assert np.abs(got - want).max() < TOLERANCE
