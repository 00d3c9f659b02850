"""Blocks copied from a request's own text as one of a round's blocks (runtime/lookup.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from protocol import GenerationParams
from runtime.bench import run_dflash, run_plain
from runtime.branches import branch_drafts
from runtime.drafters import random_drafter
from runtime.loading import LoadedModel, load_checkpoint
from runtime import lookup
from runtime.lookup import CAPACITY_STEP, MAX_MATCH, TokenHistory, context_drafts, histories_drafts
from runtime.models.dflash import DFlashDrafter
from runtime.random_targets import random_checkpoint

from .engine_rounds import assert_every_mode_makes_these_rounds

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1500}


def copied(history: list[int], n: int) -> tuple[list[int], int]:
    """The copied block and how many suffix tokens its occurrence matched."""
    tokens, matched = context_drafts(mx.array([history]), mx.array([len(history)]), n)
    return tokens[0].tolist(), int(matched[0].item())


def test_a_copied_block_continues_after_the_latest_longest_match_and_loops_with_its_period() -> None:
    assert copied([5, 1, 2, 3, 9, 1, 2], 6) == ([3, 9, 1, 2, 3, 9], 2)  # "1 2" before: then 3 9, then the loop again
    assert copied([7, 8, 7, 8, 7], 5) == ([8, 7, 8, 7, 8], 3)
    assert copied([4, 1, 6, 2, 1, 6, 3, 1], 2) == ([6, 3], 1)  # the latest of two equal matches
    assert copied([3, 6, 5, 9, 6, 4, 3, 6], 2) == ([5, 9], 2)  # "3 6" beats the later "6"
    assert copied([1, 2, 3, 4], 3) == ([4, 4, 4], 0)
    assert copied([1], 2) == ([1, 1], 0)


def test_a_match_is_capped_at_max_match_tokens_and_its_latest_occurrence_wins() -> None:
    text = [9] * (MAX_MATCH + 3)  # every earlier position ends a run as long as the cap: the latest wins
    assert copied(text + [9], 3) == ([9, 9, 9], MAX_MATCH)
    loop = [2, 5, 8] * 6
    assert copied(loop, 7) == ([2, 5, 8, 2, 5, 8, 2], MAX_MATCH)


def test_histories_of_any_length_reach_the_compiled_copy_in_few_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    # a compiled step is traced again for each new shape: on a GPU that took seconds a round
    shapes: set[tuple[int, ...]] = set()

    def recording(function, **fixed):  # type: ignore[no-untyped-def]
        def step(history: mx.array, length: mx.array) -> tuple[mx.array, mx.array]:
            shapes.add(tuple(history.shape))
            return function(history, length, **fixed)
        return step

    monkeypatch.setattr(lookup, "compiled_step", recording)
    text = [int(t) for t in np.random.default_rng(0).integers(0, 7, 300)]
    for length in range(1, 301):
        assert copied(text[:length], 5) == expected_copy(text[:length], 5)
    assert shapes == {(1, CAPACITY_STEP), (1, 2 * CAPACITY_STEP)}


def expected_copy(history: list[int], n: int) -> tuple[list[int], int]:
    """The copy rule spelled out on the host: the longest suffix (up to MAX_MATCH), its latest occurrence."""
    last = len(history) - 1
    for size in range(min(MAX_MATCH, last), 0, -1):
        for end in range(last - 1, size - 2, -1):
            if history[end - size + 1 : end + 1] == history[last - size + 1 :]:
                period = last - end
                return [history[end + 1 + i % period] for i in range(n)], size
    return [history[last]] * n, 0


def test_token_histories_append_rounds_on_the_device_and_stack_at_their_own_lengths() -> None:
    short, long = TokenHistory([7, 8], 12), TokenHistory([5, 1, 2, 3, 9], 300)
    # the tokens past a round's count land past the end: the next round's overwrite them
    tokens, matched = histories_drafts([short, long], mx.array([[7, 8, 7, 0], [1, 2, 77, 77]]), mx.array([3, 2]), 4)
    assert short.length.item() == 5 and long.length.item() == 7
    assert short.tokens.shape == (256,) and long.tokens.shape == (512,) and long.tokens[:9].tolist() == [5, 1, 2, 3, 9, 1, 2, 77, 77]
    assert tokens.tolist() == [[8, 7, 8, 7], [3, 9, 1, 2]] and matched.tolist() == [3, 2]
    tokens, _ = histories_drafts([long], mx.array([[3, 9, 5]]), mx.array([3]), 2)
    assert long.tokens[:10].tolist() == [5, 1, 2, 3, 9, 1, 2, 3, 9, 5] and tokens.tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="capacity 2"):
        TokenHistory([1, 2, 3], 2)


def test_a_history_extended_from_the_host_copies_as_the_whole_text_would() -> None:
    text = [4, 5, 6, 9, 4, 5, 6, 1, 2, 4, 5]
    history = TokenHistory(text[:3], 40)
    history.extend(text[3:7], 3)
    history.extend(text[7:], 7)
    assert history.length.item() == len(text) and history.tokens[: len(text)].tolist() == text
    tokens, matched = history.drafts(4)
    assert (tokens[0].tolist(), matched.item()) == copied(text, 4) == expected_copy(text, 4)


def test_a_found_copy_takes_the_last_blocks_place_and_a_missing_one_leaves_it() -> None:
    logits = mx.array(np.random.default_rng(1).normal(size=(2, 5, 30)).astype(np.float32))
    drafted = branch_drafts(logits, 3)
    context = (mx.array([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]), mx.array([1, 0]))
    both = branch_drafts(logits, 3, context)
    assert both[0, 2].tolist() == [1, 2, 3, 4, 5] and (both[0, :2] == drafted[0, :2]).all()
    assert (both[1] == drafted[1]).all()


def test_a_lone_block_is_the_copy_where_the_text_repeats_unless_the_drafter_finds_it_unlikely() -> None:
    # every row: token 1 at probability ~0.6, token 2 at ~0.3, the other 28 share ~0.1
    row = np.full(30, np.log(0.1 / 28)); row[1], row[2] = np.log(0.6), np.log(0.3)
    logits = mx.array(np.tile(row, (3, 4, 1)).astype(np.float32))
    twos, fives = [2, 2, 2, 2], [5, 5, 5, 5]
    context = (mx.array([twos, fives, twos]), mx.array([1, 3, 0]))
    blocks = branch_drafts(logits, 1, context)[:, 0].tolist()
    # row 0: a copy the drafter expects to run a third as far as its own block (>= COPY_SHARE): the copy;
    # row 1: one it expects to run under 1% as far: the drafter's; row 2: nothing matched: the drafter's
    assert blocks == [twos, [1, 1, 1, 1], [1, 1, 1, 1]]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return load_checkpoint(random_checkpoint("random:qwen3-8b", overrides=SMALL), "float32")


@pytest.fixture(scope="module")
def drafter(target: LoadedModel) -> DFlashDrafter:
    """A drafter that knows nothing and says so: every row's logits are zero (its final norm's
    weight is), so its blocks are rarely right and it finds no copy less likely than its own."""
    drafter = random_drafter(target, 1, False, block_size=8)
    drafter.norm.weight = mx.zeros_like(drafter.norm.weight)
    return drafter


def test_copied_blocks_win_rounds_on_looping_text_and_every_mode_keeps_the_reference_loops_rounds(
        target: LoadedModel, drafter: DFlashDrafter, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A random target's greedy text falls into loops: there a copied block is accepted far past
    the drafter's, alone (one block a round) or as the last of two; the output stays plain
    greedy's, and every engine mode, batched, makes the reference loop's rounds (the
    device-side history as the host's)."""
    params = GenerationParams(max_tokens=200)
    ids = [target.tokenizer.encode(text) for text in ("def add(a, b):", "Once upon a time", "x")]
    want = [run_plain(target, p, params).token_ids for p in ids]
    reference: dict[int, list[list[tuple[int, int, list[int]]]]] = {1: [], 2: []}
    for branches, rounds in reference.items():
        for p, plain in zip(ids, want):
            result, stats = run_dflash(target, drafter, p, params, branches)
            assert result.token_ids == plain
            rounds.append([(r.facts.accepted, r.facts.branch, r.facts.committed) for r in stats.rounds])
    with monkeypatch.context() as patch:
        patch.setattr(DFlashDrafter, "copies_blocks", property(lambda self: False))
        drafters_alone = sum(len(run_dflash(target, drafter, p, params, 1)[1].rounds) for p in ids)
    assert sum(map(len, reference[1])) < 0.85 * drafters_alone
    assert sum(map(len, reference[2])) <= sum(map(len, reference[1]))
    assert any(branch == 1 and accepted >= 4 for rounds in reference[2] for accepted, branch, _ in rounds)
    for branches, rounds in reference.items():
        assert_every_mode_makes_these_rounds(target, drafter, ids, params, branches, rounds, want, tmp_path / str(branches))
