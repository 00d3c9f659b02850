"""Rounds that verify several drafted blocks and keep the one accepted furthest (runtime/branches.py)."""

from __future__ import annotations

import anyio
import mlx.core as mx
import numpy as np
import pytest

from protocol import GenerationParams
from runtime.acceptance import branch_verdict_rows
from runtime.bench import run_dflash, run_plain, run_together
from runtime.branches import block_tokens, branch_drafts, keep_branch, kept_rows
from runtime.cache import DeviceKVCache, KVCache, causal_mask, stack_layers
from runtime.drafters import random_drafter
from runtime.engine import Engine
from runtime.loading import LoadedModel, load_checkpoint
from runtime.models.dflash import Proposal
from runtime.oracle import OracleDrafter
from runtime.random_targets import greedy_successor, random_checkpoint

from .engine_rounds import assert_every_mode_makes_these_rounds

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1500}


class BranchingOracle(OracleDrafter):
    """On a random target: block ``b`` of a round is right for its first ``(anchor + 5b) % 9``
    drafts, so which block a round keeps, and how much it accepts, are known."""

    def propose(self, hidden: mx.array, anchors: mx.array, temperatures: mx.array | None = None,
                noise: mx.array | None = None, branches: int = 1,
                context: tuple[mx.array, mx.array] | None = None) -> Proposal:
        real = super().propose(hidden, anchors, temperatures, noise, branches)  # the copied blocks set aside
        n = hidden.shape[1]
        right = self._continuation[anchors.astype(mx.int32)][:, None, :n]
        wrong = mx.arange(n) >= expected_accepted(anchors, branches)[..., None]
        return Proposal(mx.where(real.tokens < 0, real.tokens, mx.where(wrong, (right + 1) % self._vocab, right)), None)


def expected_accepted(anchors: mx.array, branches: int) -> mx.array:
    return (anchors.astype(mx.int32)[:, None] + 5 * mx.arange(branches)) % 9


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return load_checkpoint(random_checkpoint("random:qwen3-8b", overrides=SMALL), "float32")


@pytest.fixture(scope="module")
def oracle(target: LoadedModel) -> BranchingOracle:
    drafter = random_drafter(target, 2, False, block_size=16, drafter_class=BranchingOracle)
    return drafter.aim(greedy_successor(target.config), 2.0)  # type: ignore[return-value]


def prompts(target: LoadedModel) -> list[list[int]]:
    return [target.tokenizer.encode(text) for text in ("def add(a, b):", "Tell me a story about a robot. " * 3, "x")]


def test_a_blocks_rows_see_the_cache_and_their_own_block_only() -> None:
    mask = np.array(causal_mask(9, 3, 6, 2))
    for i in range(6):
        own = 3 + 2 * (i // 2)
        assert [j for j in range(9) if mask[i, j]] == [0, 1, 2] + list(range(own, 3 + i + 1))
    stacked = np.array(causal_mask(9, mx.array([1, 3]), 6, 2))
    assert (stacked[1] == mask).all() and stacked[0, 5].tolist() == [1, 0, 0, 0, 0, 1, 1, 0, 0]


def test_blocks_verified_together_equal_each_block_verified_alone(target: LoadedModel) -> None:
    """Logits and taps of K blocks in one forward equal K forwards of one block each, over
    host caches and over stacked device caches (each request at its own length), and the
    cache then holds the kept block's rows where a lone block's would be."""
    model, prompt_sets = target.model, [[5, 9, 31, 7, 2], [40, 41, 42]]
    blocks = mx.array([[[3, 8, 1], [3, 9, 4], [3, 8, 2]], [[6, 6, 6], [7, 1, 1], [2, 2, 2]]], dtype=mx.int32)
    taps = (1, 4)

    def prefilled(ids: list[int]) -> list[KVCache]:
        cache = model.make_cache()
        model(mx.array([ids]), cache)
        return cache

    alone = [[model(blocks[r, b][None], prefilled(ids), tap_layers=taps) for b in range(3)] for r, ids in enumerate(prompt_sets)]
    for r, ids in enumerate(prompt_sets):
        together = model(blocks[r].reshape(1, -1), prefilled(ids), tap_layers=taps, branch=3)
        for b in range(3):
            assert mx.allclose(together.logits[0, 3 * b : 3 * b + 3], alone[r][b].logits[0], atol=1e-4)
            assert mx.allclose(together.taps[0, 3 * b : 3 * b + 3], alone[r][b].taps[0], atol=1e-4)

    device = []
    for ids in prompt_sets:
        cache = model.make_device_cache()
        model.prefill(ids, cache)
        device.append(cache)
    caches = stack_layers(device, 9, 2)
    start = caches[0].length
    together = model(blocks.reshape(2, -1), caches, tap_layers=taps, branch=3)
    kept = mx.array([2, 1], dtype=mx.int32)
    for r in range(2):
        for b in range(3):
            assert mx.allclose(together.logits[r, 3 * b : 3 * b + 3], alone[r][b].logits[0], atol=1e-4)
    assert mx.allclose(kept_rows(together.taps, kept, 3)[1], alone[1][1].taps[0], atol=1e-4)
    keep_branch(caches, start, kept, 3)
    for r, ids in enumerate(prompt_sets):
        lone = prefilled(ids)
        model(blocks[r, int(kept[r].item())][None], lone)
        n = len(ids)
        assert mx.allclose(caches[0].keys[r, :, n : n + 3], lone[0].keys[0, :, n : n + 3], atol=1e-5)
        assert mx.allclose(caches[-1].values[r, :, : n + 3], lone[-1].values[0, :, : n + 3], atol=1e-5)


def test_keeping_a_block_moves_its_rows_where_a_lone_blocks_would_be_and_nothing_else() -> None:
    """Stacked requests, each with its own write position and kept block (the verifier's case),
    and a lone request with scalars; keys and values of different widths."""
    rng = np.random.default_rng(0)
    width, capacity = 4, 40
    for start, branch in (([3, 9], [2, 0]), ([5], [1]), (7, 3)):
        rows = len(start) if isinstance(start, list) else 1
        keys = rng.standard_normal((rows, 2, capacity, 8)).astype(np.float32)
        values = rng.standard_normal((rows, 2, capacity, 6)).astype(np.float32)
        caches = [DeviceKVCache()]
        caches[0].keys, caches[0].values = mx.array(keys), mx.array(values)
        keep_branch(caches, mx.array(start, dtype=mx.int32), mx.array(branch, dtype=mx.int32), width)
        for got, buffer in ((caches[0].keys, keys), (caches[0].values, values)):
            want = buffer.copy()
            for r, (s, b) in enumerate(zip(np.atleast_1d(start), np.atleast_1d(branch))):
                want[r, :, s : s + width] = buffer[r, :, s + b * width : s + (b + 1) * width]
            np.testing.assert_array_equal(np.array(got), want)


def test_branch_drafts_swap_in_the_runner_ups_the_drafter_expects_to_gain_most() -> None:
    """Block 0 is the argmax; each other block swaps one row for one of its best runner-ups, in
    order of P(rows before right) x p(runner-up) x (1 + the run expected after), recomputed here."""
    logits = np.random.default_rng(0).normal(size=(2, 5, 50)).astype(np.float32) * 3
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1)
    got = np.array(branch_drafts(mx.array(logits), 6))
    assert got.shape == (2, 6, 5) and (got[:, 0] == order[..., 0]).all()
    for r in range(2):
        p1 = np.take_along_axis(probs[r], order[r, :, :1], axis=-1)[:, 0]
        gains = {}
        for i in range(5):
            run_after = sum(np.prod(p1[i + 1 : m + 1]) for m in range(i + 1, 5))
            for rank in (1, 2, 3):
                gains[(i, rank)] = np.prod(p1[:i]) * probs[r, i, order[r, i, rank]] * (1 + run_after)
        for b, (i, rank) in enumerate(sorted(gains, key=gains.get, reverse=True)[:5], 1):
            want = order[r, :, 0].copy()
            want[i] = order[r, i, rank]
            assert (got[r, b] == want).all()
    small = np.array(branch_drafts(mx.array(logits[:, :1]), 6))  # one row: three runner-ups, then block 0 again
    assert (small[:, 4:] == small[:, :1]).all() and len({tuple(b) for b in small[0, :4]}) == 4
    assert (block_tokens(mx.array([7, 8]), mx.array(got[:, :2])).reshape(2, 2, 6)[:, :, 0] == mx.array([[7, 7], [8, 8]])).all()


def test_the_verdict_keeps_the_block_accepted_furthest_and_the_earlier_of_equals() -> None:
    vocab, n = 10, 4
    target_tokens = mx.array([[1, 2, 3, 4, 5]] * 3 + [[6, 6, 6, 6, 6]] * 3)  # [R*K, n+1] for R=2, K=3
    logits = mx.where(mx.arange(vocab) == target_tokens[..., None], 1.0, 0.0).reshape(2, 3 * (n + 1), vocab)
    drafts = mx.array([[[1, 9, 9, 9], [1, 2, 3, 9], [1, 2, 9, 9]],
                       [[6, 6, 9, 9], [6, 6, 9, 9], [9, 9, 9, 9]]])
    verdict, kept = branch_verdict_rows(drafts, logits, mx.array([n, 2]))
    assert kept.tolist() == [1, 0] and verdict.accepted.tolist() == [3, 2] and verdict.bonus.tolist() == [4, 6]


@pytest.mark.parametrize("branches", [2, 4, 8])
def test_the_reference_loop_keeps_the_best_block_and_stays_plain_greedy(target: LoadedModel, oracle: BranchingOracle,
                                                                         branches: int) -> None:
    params = GenerationParams(max_tokens=120)
    for ids in prompts(target):
        result, stats = run_dflash(target, oracle, ids, params, branches)
        assert result.token_ids == run_plain(target, ids, params).token_ids
        sequence = ids + result.token_ids
        for r in stats.rounds:
            per_block = expected_accepted(mx.array([sequence[r.facts.committed_before - 1]]), branches)[0].tolist()
            assert r.facts.accepted == max(per_block) and r.facts.branch == per_block.index(max(per_block))
        assert any(r.facts.branch > 0 for r in stats.rounds)


def test_every_engine_mode_keeps_the_blocks_the_reference_loop_keeps(target: LoadedModel, oracle: BranchingOracle,
                                                                    tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Batched (three requests at their own lengths), in every mode: the same rounds as the
    reference loop, block kept included, and plain greedy's output."""
    params, ids = GenerationParams(max_tokens=90), prompts(target)
    want = [run_plain(target, p, params).token_ids for p in ids]
    reference = [[(r.facts.accepted, r.facts.branch, r.facts.committed) for r in run_dflash(target, oracle, p, params, 4)[1].rounds]
                 for p in ids]
    assert_every_mode_makes_these_rounds(target, oracle, ids, params, 4, reference, want, tmp_path)


def test_a_sampled_request_keeps_its_first_block_and_draws_as_with_one(target: LoadedModel, oracle: BranchingOracle) -> None:
    params = GenerationParams(max_tokens=40, temperature=0.8, seed=3)
    ids = prompts(target)[:2]
    one = anyio.run(run_together, target, oracle, ids, params, "pipelined", None, 1)
    four = anyio.run(run_together, target, oracle, ids, params, "pipelined", None, 4)
    assert [t for t, _ in four.results] == [t for t, _ in one.results]


def test_an_unknown_branch_count_is_refused(target: LoadedModel, oracle: BranchingOracle) -> None:
    with pytest.raises(ValueError, match="branches must be 1 to 16"):
        Engine(target, oracle, branches=17)
