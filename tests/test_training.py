"""DFlash drafter training (runtime.training, python -m runtime.train) on tiny fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from protocol import GenerationParams
from runtime import train as train_cli
from runtime.errors import CheckpointError
from runtime.loading import LoadedModel, load_drafter
from runtime.models.dflash import DFlashDrafter
from runtime.plain import plain_steps
from runtime.sampling import Sampler
from runtime.errors import RuntimeErrorBase
from runtime.training.batches import (block_labels, decoded_rounds, leading_hits, make_micro_batch, sample_anchors, spread,
                                      training_mask)
from runtime.training.corpora import DataError, Prompt, even_shares, file_prompts, is_heldout, load_prompts
from runtime.training import data as data_module
from runtime.training.data import Example, GenerationLimits, ResponseCache, build_examples, greedy_batch, regenerated
from runtime.training.followups import follow_up_prompts
from runtime.training.average import average_drafters
from runtime.training.drafter import DrafterShape, choose_mask_token, drafter_config, new_drafter, write_z_lab_folder
from runtime.speculative import SpeculativeStats, generate_speculative
from runtime.training.trainer import Trainer, TrainSettings, block_logits, candidate_hits, teacher_rows

from . import fixtures

BLOCK = 4
MASK_ID = 5  # the tiny vocabulary has no spare row: reuse a token, as for SmolLM2
TAPS = (1, 2)


def tiny_config(target: LoadedModel, layers: int = 2) -> dict:
    return drafter_config(target.model.args, DrafterShape(layers=layers, block_size=BLOCK, taps=TAPS), MASK_ID)


def loud_drafter(target: LoadedModel, seed: int = 0) -> DFlashDrafter:
    """Larger random weights than the training init, so every input visibly moves the output."""
    drafter = new_drafter(tiny_config(target), seed)
    drafter.update(tree_map(lambda p: p * 8 if p.ndim == 2 else p, drafter.parameters()))
    return drafter.bind(target.model)


def random_example(rng: np.random.Generator, prompt_len: int, response_len: int, key: str = "k") -> Example:
    tokens = rng.integers(3, 300, size=prompt_len + response_len).tolist()
    return Example(key, tokens[:prompt_len], tokens[prompt_len:], "test", "train")


# ---------------------------------------------------------------- anchors, labels, mask


def test_anchors_lie_in_the_response_with_a_whole_block_after_them() -> None:
    rng = np.random.default_rng(0)
    anchors = sample_anchors(prompt_len=10, length=40, block_size=BLOCK, count=8, rng=rng)
    assert len(anchors) == 8 == len(set(anchors.tolist()))
    assert anchors.min() >= 10 and anchors.max() <= 40 - BLOCK
    every = sample_anchors(prompt_len=10, length=16, block_size=BLOCK, count=8, rng=rng)
    assert every.tolist() == list(range(10, 13))  # fewer candidates than asked: all of them


def test_decoded_rounds_start_one_past_each_rounds_delivered_tokens() -> None:
    hits = np.array([[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1],
                     [1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0, 0]], dtype=bool)
    # 0 accepts 2 -> 3 accepts 0 -> 4 accepts 1 (a hit after a miss does not count) -> 6 accepts 0 -> 7 all 3 -> past the end
    assert decoded_rounds(hits).tolist() == [0, 3, 4, 6, 7]
    assert decoded_rounds(np.zeros((4, 3), dtype=bool)).tolist() == [0, 1, 2, 3]
    assert spread(np.arange(10), 4).tolist() == [0, 3, 6, 9] and spread(np.arange(3), 4).tolist() == [0, 1, 2]


def test_labels_are_same_position_and_row_zero_predicts_nothing() -> None:
    rng = np.random.default_rng(1)
    example = random_example(rng, 6, 20)
    x = example.tokens
    anchors = np.array([6, 11, 22])
    batch = make_micro_batch([example], [anchors], blocks_per_seq=4, block_size=BLOCK, mask_token_id=MASK_ID, gamma=2.0)
    blocks = np.array(batch.blocks).reshape(4, BLOCK)
    labels, weights = np.array(batch.labels)[0], np.array(batch.weights)[0]
    for j, a in enumerate(anchors):
        assert blocks[j].tolist() == [x[a]] + [MASK_ID] * (BLOCK - 1)
        assert labels[j].tolist() == [x[a + k] for k in range(1, BLOCK)]  # row k -> x[a+k], not x[a+k+1]
        np.testing.assert_allclose(weights[j], np.exp(-np.arange(BLOCK - 1) / 2.0), rtol=1e-6)
    assert not weights[3].any()  # the padding block carries no loss
    _, valid = block_labels(x, np.array([len(x) - 2]), BLOCK)
    assert valid[0].tolist() == [True, False, False]  # only where a + k < len


def test_mask_shows_a_block_only_the_context_before_its_anchor_and_itself() -> None:
    anchors = mx.array([[3, 7, 0]])
    ctx_len, k = 10, 3
    mask = np.array(training_mask(anchors, ctx_len, BLOCK))[0, 0]
    assert mask.shape == (k * BLOCK, ctx_len + k * BLOCK)
    for q in range(k * BLOCK):
        block, a = q // BLOCK, int(anchors[0, q // BLOCK])
        sees_ctx = mask[q, :ctx_len]
        assert sees_ctx[:a].all(), "every position before the anchor is visible"
        assert not sees_ctx[a:].any(), "the anchor's own features and everything later are hidden"
        sees_blocks = mask[q, ctx_len:].reshape(k, BLOCK)
        assert sees_blocks[block].all(), "bidirectional within its own block"
        assert not np.delete(sees_blocks, block, axis=0).any(), "never another block"


# ---------------------------------------------------------------- the training forward


def test_training_forward_equals_the_decode_paths_drafter_at_every_anchor(tiny_llama: LoadedModel) -> None:
    drafter = loud_drafter(tiny_llama)
    rng = np.random.default_rng(2)
    example = random_example(rng, 8, 30)
    anchors = np.array([8, 9, 17, 33, 34])
    batch = make_micro_batch([example], [anchors], 6, BLOCK, MASK_ID, gamma=2.0)
    taps = tiny_llama.model(batch.tokens, tap_layers=drafter.tap_layers).taps
    trained = np.array(block_logits(drafter, taps, batch.blocks, batch.anchors))[0]
    for j, a in enumerate(anchors):
        block = mx.array([[example.tokens[a]] + [MASK_ID] * (BLOCK - 1)])
        decoded = np.array(drafter(block, taps[:, :a], drafter.make_cache()))[0]
        np.testing.assert_allclose(trained[j], decoded, atol=1e-4)
        # the trap the mask avoids: letting the block see its anchor's own features
        leaky = np.array(drafter(block, taps[:, : a + 1], drafter.make_cache()))[0]
        assert np.abs(leaky - trained[j]).max() > 1e-2


def test_training_forward_matches_decoding_on_a_multi_sequence_padded_batch(tiny_llama: LoadedModel) -> None:
    drafter = loud_drafter(tiny_llama, seed=3)
    rng = np.random.default_rng(3)
    examples = [random_example(rng, 5, 12), random_example(rng, 9, 40)]
    anchors = [np.array([5, 10]), np.array([9, 20, 45])]
    batch = make_micro_batch(examples, anchors, 3, BLOCK, MASK_ID, gamma=2.0)
    taps = tiny_llama.model(batch.tokens, tap_layers=drafter.tap_layers).taps
    trained = np.array(block_logits(drafter, taps, batch.blocks, batch.anchors))
    for i, (example, picked) in enumerate(zip(examples, anchors)):
        for j, a in enumerate(picked):
            block = mx.array([[example.tokens[a]] + [MASK_ID] * (BLOCK - 1)])
            decoded = np.array(drafter(block, taps[i : i + 1, :a], drafter.make_cache()))[0]
            np.testing.assert_allclose(trained[i, j], decoded, atol=1e-4)


def test_a_shorter_block_trains_as_the_decode_path_drafts_a_block_of_that_length(tiny_llama: LoadedModel) -> None:
    drafter = loud_drafter(tiny_llama, seed=4)
    rng = np.random.default_rng(4)
    example = random_example(rng, 8, 30)
    anchors, lengths = np.array([8, 17, 25]), np.array([2, 3, BLOCK])
    batch = make_micro_batch([example], [anchors], 4, BLOCK, MASK_ID, gamma=2.0, length_lists=[lengths])
    weights = np.array(batch.weights)[0]
    for j, length in enumerate(lengths):  # rows past a block's length carry no loss
        assert weights[j, : length - 1].all() and not weights[j, length - 1 :].any()
    taps = tiny_llama.model(batch.tokens, tap_layers=drafter.tap_layers).taps
    trained = np.array(block_logits(drafter, taps, batch.blocks, batch.anchors, batch.lengths))[0]
    full = np.array(block_logits(drafter, taps, batch.blocks, batch.anchors))[0]
    for j, (a, length) in enumerate(zip(anchors, lengths)):
        block = mx.array([[example.tokens[a]] + [MASK_ID] * (int(length) - 1)])
        decoded = np.array(drafter(block, taps[:, :a], drafter.make_cache()))[0]
        np.testing.assert_allclose(trained[j, : length - 1], decoded, atol=1e-4)
        if length < BLOCK:  # without the lengths, the missing rows would be seen
            assert np.abs(full[j, : length - 1] - decoded).max() > 1e-2


# ---------------------------------------------------------------- the loop


def tiny_trainer(target: LoadedModel, examples: list[Example], dtype: mx.Dtype = mx.float32, **settings) -> Trainer:
    drafter = new_drafter(tiny_config(target), seed=0, dtype=dtype).bind(target.model)
    base = dict(epochs=4, batch_size=4, micro_batch=2, anchors_per_seq=8, lr=3e-3, compile=False)
    return Trainer(target.model, drafter, examples, TrainSettings(**{**base, **settings}), dtype)


@pytest.fixture(scope="module")
def examples() -> list[Example]:
    """Sequences with a learnable pattern: the response repeats a short cycle."""
    rng = np.random.default_rng(4)
    out = []
    for i in range(8):
        cycle = rng.integers(3, 300, size=3).tolist()
        prompt = rng.integers(3, 300, size=6).tolist() + cycle
        out.append(Example(str(i), prompt, (cycle * 10)[:24], "test", "train"))
    return out


def test_training_steps_lower_the_loss(tiny_llama: LoadedModel, examples: list[Example]) -> None:
    trainer = tiny_trainer(tiny_llama, examples, epochs=10, lr=1e-2)
    before = trainer.evaluate(examples)
    for _ in range(trainer.total_steps):
        stats = trainer.train_step()
        assert np.isfinite(stats.loss) and stats.tokens > 0
    after = trainer.evaluate(examples)
    assert after.loss < before.loss / 2
    assert after.accuracy > 0.2 and after.acceptance > before.acceptance


def test_training_over_mixed_block_sizes_draws_each_blocks_length_from_the_seed(
        tiny_llama: LoadedModel, examples: list[Example]) -> None:
    trainer = tiny_trainer(tiny_llama, examples, block_sizes=(2, 3))
    _, anchors, lengths = trainer.batch_for(0)
    assert all(len(a) == len(n) for a, n in zip(anchors, lengths))
    drawn = np.concatenate(lengths)
    assert set(drawn.tolist()) == {2, 3}
    again = tiny_trainer(tiny_llama, examples, block_sizes=(2, 3)).batch_for(0)[2]
    assert all((x == y).all() for x, y in zip(lengths, again))
    assert np.isfinite(trainer.train_step().loss)
    assert {int(n) for n in np.concatenate(tiny_trainer(tiny_llama, examples).batch_for(0)[2])} == {BLOCK}
    with pytest.raises(RuntimeErrorBase, match="--block-sizes"):
        tiny_trainer(tiny_llama, examples, block_sizes=(BLOCK + 1,))


def test_teacher_rows_are_the_targets_predictions_of_each_rows_label(tiny_llama: LoadedModel) -> None:
    """On the target's own greedy continuation every teacher row's argmax is the row's label."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (7, 5)]
    responses = greedy_batch(tiny_llama.model, prompts, max_new=14, stop_ids=frozenset())
    examples = [Example(str(i), p, r, "test", "train") for i, (p, r) in enumerate(zip(prompts, responses))]
    anchors = [sample_anchors(len(e.prompt_ids), len(e), BLOCK, 6, rng) for e in examples]
    batch = make_micro_batch(examples, anchors, 6, BLOCK, MASK_ID, gamma=2.0)
    teacher = teacher_rows(tiny_llama.model(batch.tokens).logits, batch.anchors, BLOCK)
    valid = np.array(batch.weights) > 0
    assert teacher.shape == (*batch.labels.shape, tiny_llama.model.args.vocab_size) and valid.sum() > 10
    assert (np.array(mx.argmax(teacher, axis=-1))[valid] == np.array(batch.labels)[valid]).all()


def test_the_distilled_loss_is_the_cross_entropy_at_share_0_and_the_kl_at_share_1(
        tiny_llama: LoadedModel, examples: list[Example]) -> None:
    trainer = tiny_trainer(tiny_llama, examples, distill=1.0)
    batch, anchors, _ = trainer.batch_for(0)
    micro = trainer.micro_batch(batch[:2], anchors[:2])
    inputs = trainer.loss_inputs(micro, *trainer.target_pass(micro.tokens))
    drafted = block_logits(trainer.drafter, *inputs[:4])
    itself = trainer._distilled_loss_sum(*inputs[:-1], drafted)  # the drafter's own distribution: KL 0
    assert abs(itself.item()) < 1e-3
    kl = trainer._distilled_loss_sum(*inputs)
    plain = tiny_trainer(tiny_llama, examples, distill=0.0)
    assert plain._distilled_loss_sum(*inputs).item() == pytest.approx(plain._loss_sum(*inputs[:-1]).item(), rel=1e-5)
    assert kl.item() > 0.1 and kl.item() != pytest.approx(plain._loss_sum(*inputs[:-1]).item(), rel=1e-2)


def test_distilled_training_lowers_the_loss(tiny_llama: LoadedModel, examples: list[Example]) -> None:
    trainer = tiny_trainer(tiny_llama, examples, epochs=10, lr=1e-2, distill=0.5)
    before = trainer.evaluate(examples)
    first = trainer.train_step().loss
    for _ in range(trainer.total_steps - 1):
        last = trainer.train_step().loss
    assert np.isfinite(last) and last < first / 2
    assert trainer.evaluate(examples).loss < before.loss / 2
    with pytest.raises(RuntimeErrorBase, match="--distill"):
        tiny_trainer(tiny_llama, examples, distill=1.5)


@pytest.fixture(scope="module")
def greedy_examples(tiny_llama: LoadedModel) -> list[Example]:
    """The target's own greedy continuations of random prompts, as regeneration makes them."""
    rng = np.random.default_rng(21)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (5, 7, 6, 9, 8, 5, 7, 6)]
    responses = greedy_batch(tiny_llama.model, prompts, max_new=40, stop_ids=frozenset())
    return [Example(str(i), p, r, "test", "train") for i, (p, r) in enumerate(zip(prompts, responses))]


@pytest.fixture(scope="module")
def half_trained(tiny_llama: LoadedModel, greedy_examples: list[Example]) -> Trainer:
    """A drafter trained until it drafts some rows right and misses others."""
    trainer = tiny_trainer(tiny_llama, greedy_examples, epochs=10, lr=1e-2)
    for _ in range(trainer.total_steps):
        trainer.train_step()
    return trainer


def test_the_decoded_rounds_are_the_reference_loops_rounds(tiny_llama: LoadedModel, greedy_examples: list[Example],
                                                           half_trained: Trainer) -> None:
    drafter = half_trained.drafter
    seen = []
    for example in greedy_examples:
        taps = tiny_llama.model(mx.array([example.tokens]), tap_layers=drafter.tap_layers).taps
        hits = candidate_hits(drafter, [example], taps, per_pass=8)[0]
        simulated = leading_hits(hits[decoded_rounds(hits)]).tolist()
        stats = SpeculativeStats()
        params = GenerationParams(max_tokens=len(example.response_ids), block_size=BLOCK)
        emissions = generate_speculative(tiny_llama.model, drafter, tiny_llama.tokenizer, example.prompt_ids, params, stats)
        for _ in emissions:
            pass
        decoded = [r.facts.accepted for r in stats.rounds]
        assert decoded[: len(simulated)] == simulated  # the loop's last rounds have no whole block in x
        seen += simulated
    assert 0 in seen and max(seen) > 0, "the drafter must both miss and hit for this to test anything"


def test_training_on_decoded_rounds_puts_them_first_and_lowers_the_loss(
        tiny_llama: LoadedModel, greedy_examples: list[Example], half_trained: Trainer) -> None:
    count = 36  # anchors a sequence (of 37): more than its rounds, so the uniform ones fill up (spread's test: above)
    trainer = tiny_trainer(tiny_llama, greedy_examples, epochs=6, lr=1e-2, anchors="rounds", anchors_per_seq=count)
    trainer.drafter.update(half_trained.drafter.parameters())
    examples, uniform, _ = trainer.batch_for(0)
    taps = trainer.target_pass(trainer.micro_batch(examples, uniform).tokens)[0]
    chosen = trainer.round_anchors(examples, taps, uniform)
    some_filled = False
    for example, hits, picked, fill in zip(examples, trainer.candidate_hits(examples, taps), chosen, uniform):
        rounds = set(spread(len(example.prompt_ids) + decoded_rounds(hits), count).tolist())
        assert rounds <= set(picked.tolist()) and len(picked) == min(count, len(hits)) == len(set(picked.tolist()))
        assert set(picked.tolist()) - rounds <= set(fill.tolist())  # the rest are uniform anchors
        some_filled = some_filled or len(rounds) < len(picked)
    assert some_filled, "some sequence must have fewer rounds than anchors, so the uniform fill is tested"
    before = trainer.evaluate(greedy_examples)
    for _ in range(trainer.total_steps):
        assert np.isfinite(trainer.train_step().loss)
    after = trainer.evaluate(greedy_examples)
    assert after.loss < before.loss and after.decoded >= before.decoded
    with pytest.raises(RuntimeErrorBase, match="--anchors"):
        tiny_trainer(tiny_llama, greedy_examples, anchors="rounds", block_sizes=(2,))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16-with-float32-master"])
def test_resuming_a_checkpoint_gives_the_uninterrupted_next_step(
    tmp_path: Path, tiny_llama: LoadedModel, examples: list[Example], dtype: mx.Dtype,
) -> None:
    straight = tiny_trainer(tiny_llama, examples, dtype, compile=True)
    for _ in range(3):
        expected = straight.train_step()
    first = tiny_trainer(tiny_llama, examples, dtype, compile=True)
    first.train_step(), first.train_step()
    fingerprint = first.fingerprint({})
    first.save_checkpoint(tmp_path / "ckpt", fingerprint)
    resumed = tiny_trainer(tiny_llama, examples, dtype, compile=True)
    resumed.load_checkpoint(tmp_path / "ckpt", fingerprint)
    got = resumed.train_step()
    assert (got.step, got.loss, got.lr) == (expected.step, expected.loss, expected.lr)
    for (name, a), (_, b) in zip(tree_flatten(straight.master.parameters()), tree_flatten(resumed.master.parameters())):
        assert mx.array_equal(a, b), name


def test_resuming_with_other_settings_is_refused(tmp_path: Path, tiny_llama: LoadedModel, examples: list[Example]) -> None:
    trainer = tiny_trainer(tiny_llama, examples)
    trainer.save_checkpoint(tmp_path / "ckpt", trainer.fingerprint({}))
    other = tiny_trainer(tiny_llama, examples, lr=1e-3)
    with pytest.raises(Exception, match="different settings"):
        other.load_checkpoint(tmp_path / "ckpt", other.fingerprint({}))


# ---------------------------------------------------------------- regeneration


def test_batched_regeneration_equals_one_at_a_time_greedy(tiny_llama: LoadedModel) -> None:
    model = tiny_llama.model
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (9, 4, 7, 9, 1)]  # left padding of 0..8
    batched = greedy_batch(model, prompts, max_new=12, stop_ids=frozenset())
    greedy = Sampler(GenerationParams(temperature=0.0))
    for prompt, row in zip(prompts, batched):
        steps = plain_steps(model, prompt, greedy)
        assert row == [next(steps) for _ in range(12)]


def test_regeneration_drops_finished_rows_and_each_still_equals_one_at_a_time_greedy(
        tiny_llama: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama.model
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 300, size=n).tolist() for n in (9, 4, 7, 9, 1, 6, 3, 8)]
    greedy = Sampler(GenerationParams(temperature=0.0))
    alone = [[t for _, t in zip(range(24), plain_steps(model, p, greedy))] for p in prompts]
    # stop tokens that end the rows at different steps, so rows leave the batch while others run
    ends = sorted({row[k] for row, k in zip(alone, (2, 5, 9, 13, 30, 30, 30, 30)) if k < 24})
    stops = frozenset(ends)
    calls: list[int] = []
    keep_rows = data_module.LeftPaddedKVCache.keep_rows

    def counted_keep_rows(self: data_module.LeftPaddedKVCache, rows: mx.array) -> None:
        calls.append(rows.size)
        keep_rows(self, rows)

    monkeypatch.setattr(data_module, "COMPACT_EVERY", 2)
    monkeypatch.setattr(data_module.LeftPaddedKVCache, "keep_rows", counted_keep_rows)
    batched = greedy_batch(model, prompts, max_new=24, stop_ids=stops)
    assert calls, "finished rows were never dropped"
    for row, expected in zip(batched, alone):
        cut = next((i + 1 for i, t in enumerate(expected) if t in stops), len(expected))
        assert row == expected[:cut]


def test_regeneration_cuts_at_the_stop_token_and_is_cached(tmp_path: Path, tiny_llama: LoadedModel) -> None:
    prompts = [Prompt("t", text=t) for t in ("def add(a, b):", "The quick brown", "naïve café", "fox jumps")]
    limits = GenerationLimits(max_new_tokens=10, max_seq_len=64)
    cache = ResponseCache(tmp_path / "responses.jsonl")
    made = build_examples(tiny_llama.model, tiny_llama.tokenizer, prompts, limits, cache, heldout_fraction=0.5)
    stops = tiny_llama.tokenizer.eos_token_ids
    for example, prompt in zip(made, prompts):
        assert example.prompt_ids == tiny_llama.tokenizer.encode(prompt.text)
        assert 1 <= len(example.response_ids) <= 10
        assert not stops & set(example.response_ids[:-1]), "nothing is kept after a stop token"
        assert example.split == ("heldout" if is_heldout(prompt, 0.5) else "train")
    lines = (tmp_path / "responses.jsonl").read_text().splitlines()
    again = build_examples(tiny_llama.model, tiny_llama.tokenizer, prompts, limits,
                           ResponseCache(tmp_path / "responses.jsonl"), heldout_fraction=0.5)
    assert again == made and (tmp_path / "responses.jsonl").read_text().splitlines() == lines


def test_follow_ups_continue_finished_training_chats_with_the_targets_own_reply(
        tmp_path: Path, tiny_llama: LoadedModel) -> None:
    tokenizer = tiny_llama.tokenizer
    eos = min(tokenizer.eos_token_ids)
    pairs = []
    for i in range(8):
        prompt = Prompt("chat", messages=(("user", f"question {i}?"),))
        ended = i != 6  # reply 6 was cut at the length cap: nobody answers half a reply
        response = tokenizer.encode(f"answer {i}.", add_special_tokens=False) + ([eos] if ended else [])
        pairs.append((prompt, Example(f"k{i}", [1, 2, 3], response, "chat", "heldout" if i == 7 else "train")))
    pairs.append((Prompt("code-def", text="def f():"), Example("raw", [4, 5], [6, eos], "code-def", "train")))
    made = follow_up_prompts(pairs, tokenizer, count=10, seed=0)
    assert len(made) == 6 and made == follow_up_prompts(pairs, tokenizer, count=10, seed=0)
    by_question = {p.messages[0][1]: p for p in made}
    assert set(by_question) == {f"question {i}?" for i in range(6)}
    for i in range(6):
        (_, question), (role, reply), (last_role, ask) = by_question[f"question {i}?"].messages
        assert (role, reply, last_role) == ("assistant", f"answer {i}.", "user") and ask.strip()
        assert by_question[f"question {i}?"].source == "chat+follow-up"
    assert len(follow_up_prompts(pairs, tokenizer, count=2, seed=0)) == 2
    limits = GenerationLimits(max_new_tokens=6, max_seq_len=256)
    cache = ResponseCache(tmp_path / "responses.jsonl")
    for prompt, example in regenerated(tiny_llama.model, tokenizer, made[:2], limits, cache, heldout_fraction=0.0):
        assert prompt.messages[1][1] in tokenizer.decode(example.prompt_ids) and example.response_ids


# ---------------------------------------------------------------- prompts


def test_file_prompts_read_messages_prompts_text_and_plain_lines(tmp_path: Path) -> None:
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old reply"}]},
        {"prompt": "What is 2+2?"},
        {"text": "def f(x):"},
    ]))
    got = file_prompts(jsonl)
    assert got[0].messages == (("user", "hi"),)  # the reply to regenerate is dropped
    assert got[1].messages == (("user", "What is 2+2?"),)
    assert got[2].text == "def f(x):" and not got[2].messages
    plain = tmp_path / "p.txt"
    plain.write_text("first\n\nsecond\n")
    assert [p.messages for p in file_prompts(plain)] == [(("user", "first"),), (("user", "second"),)]


def test_humaneval_is_never_training_data(tmp_path: Path) -> None:
    by_name = tmp_path / "HumanEval.jsonl"
    by_name.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    by_task = tmp_path / "tasks.jsonl"
    by_task.write_text(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():"}) + "\n")
    for path in (by_name, by_task):
        with pytest.raises(DataError, match="evaluation only"):
            file_prompts(path)


def test_selection_and_split_are_stable_across_sample_counts(tmp_path: Path) -> None:
    lines = tmp_path / "many.txt"
    lines.write_text("\n".join(f"question number {i}" for i in range(200)))
    few, more = load_prompts([str(lines)], 20, seed=0), load_prompts([str(lines)], 50, seed=7)
    assert set(few) <= set(more), "a larger pick keeps the smaller one (cached responses stay useful)"
    assert [is_heldout(p, 0.1) for p in few] == [is_heldout(p, 0.1) for p in more[:20]]
    held = sum(is_heldout(p, 0.1) for p in more)
    assert 1 <= held <= 12, "a pick is not biased towards (or away from) the held-out prompts"


def test_a_prompt_held_by_two_sources_is_trained_once(tmp_path: Path) -> None:
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("shared question\nonly in the first\n")
    second.write_text("only in the second\nshared question\n")
    prompts = load_prompts([str(first), str(second)], 10, seed=0)
    contents = [p.content() for p in prompts]
    assert len(contents) == len(set(contents)) == 3
    assert sum("shared question" in c for c in contents) == 1


def test_a_small_source_leaves_its_unused_share_to_the_others(tmp_path: Path) -> None:
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text("\n".join(f"small question {i}" for i in range(3)))
    large.write_text("\n".join(f"large question {i}" for i in range(100)))
    prompts = load_prompts([str(small), str(large)], 20, seed=0)
    contents = [p.content() for p in prompts]
    assert len(contents) == 20
    assert sum("small question" in c for c in contents) == 3
    other = tmp_path / "other.txt"
    other.write_text("\n".join(f"other question {i}" for i in range(100)))
    both = [p.content() for p in load_prompts([str(large), str(other)], 21, seed=0)]
    assert sum("large question" in c for c in both) == sum("other question" in c for c in both) == 11


def test_even_shares_split_what_small_sources_cannot_fill() -> None:
    assert even_shares([100, 100], 21) == [11, 11]  # equal shares rounded up, as before any source ran short
    assert even_shares([5, 100, 100], 60) == [5, 28, 28]
    assert even_shares([5, 8], 60) == [5, 8]
    assert even_shares([], 10) == []


def test_gsm_training_prompts_avoid_the_evaluation_seeds() -> None:
    pytest.importorskip("reasoning_gym")
    import reasoning_gym

    from runtime.training.corpora import GSM_EVAL_SEEDS, gsm_prompts

    train = {p.messages[0][1] for p in gsm_prompts(20, seed=0)}
    evaluation = {item["question"] for item in reasoning_gym.create_dataset("gsm_symbolic", size=20, seed=GSM_EVAL_SEEDS[0])}
    assert len(train) == 20 and not train & evaluation


def test_smollm2_reuses_its_empty_output_token_as_the_mask(smollm2: LoadedModel) -> None:
    mask = choose_mask_token(smollm2.model.args, smollm2.tokenizer)
    assert mask == 16 and smollm2.tokenizer.decode([mask]) == "<empty_output>"  # no spare row to use


# ---------------------------------------------------------------- the command line and its output


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    work = tmp_path_factory.mktemp("train")
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(["Hello there", "What is two plus two?", "Tell me about foxes.",
                                  "Write code to add numbers.", "Why is the sky blue?", "Name three colours."]))
    train_cli.main([
        "--model", str(tiny_llama_dir), "--out", str(work / "out"), "--data", str(prompts), "--samples", "6",
        "--max-new-tokens", "24", "--epochs", "2", "--batch-size", "2", "--micro-batch", "2",
        "--block-size", str(BLOCK), "--layers", "2", "--taps", *map(str, TAPS), "--mask-token-id", str(MASK_ID),
        "--anchors-per-seq", "8", "--cache-dir", str(work / "cache"), "--heldout-fraction", "0",
        "--distill", "0.3", "--no-compile",  # the distilled loss end to end
    ])
    return work / "out"


def test_trained_drafter_loads_and_drafts(trained_dir: Path, tiny_llama: LoadedModel) -> None:
    config = json.loads((trained_dir / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["block_size"] == config["dflash_config"]["block_size"] == BLOCK
    assert config["dflash_config"]["target_layer_ids"] == list(TAPS)
    assert config["rope_theta"] == tiny_llama.model.args.rope_theta
    assert config["vocab_size"] == tiny_llama.model.args.vocab_size
    assert all(v.dtype == mx.bfloat16 for v in mx.load(str(trained_dir / "model.safetensors")).values())
    drafter = load_drafter(trained_dir, tiny_llama)
    ctx = tiny_llama.model(mx.array([[7, 8, 9, 10]]), tap_layers=drafter.tap_layers).taps
    logits = drafter(mx.array([[11] + [MASK_ID] * (BLOCK - 1)]), ctx, drafter.make_cache())
    assert logits.shape == (1, BLOCK - 1, tiny_llama.model.args.vocab_size)
    assert mx.all(mx.isfinite(logits)).item()


def test_a_packed_drafter_is_smaller_and_drafts_as_the_unpacked_one(trained_dir: Path, tiny_llama: LoadedModel,
                                                                      tmp_path: Path) -> None:
    from runtime.training.pack import pack_drafter

    before, after = pack_drafter(trained_dir, tmp_path / "packed", bits=8)
    assert after < 0.75 * before  # bf16 projections become 8 bits plus a bf16 scale and bias per 64
    packed, plain = load_drafter(tmp_path / "packed", tiny_llama), load_drafter(trained_dir, tiny_llama)
    ctx = tiny_llama.model(mx.array([[7, 8, 9, 10]]), tap_layers=plain.tap_layers).taps
    block = mx.array([[11] + [MASK_ID] * (BLOCK - 1)])
    ours, theirs = packed.hidden(block, ctx, packed.make_cache()), plain.hidden(block, ctx, plain.make_cache())
    scale = mx.abs(theirs).max().item()
    assert 0 < mx.abs(ours - theirs).max().item() < 0.02 * scale  # 8-bit rounding, no more
    with pytest.raises(CheckpointError, match="already packed"):
        pack_drafter(tmp_path / "packed", tmp_path / "twice")


def test_an_unpacked_drafter_is_a_z_lab_folder_again(trained_dir: Path, tiny_llama: LoadedModel, tmp_path: Path) -> None:
    from runtime.training.pack import pack_drafter, unpack_drafter

    pack_drafter(trained_dir, tmp_path / "packed")
    unpack_drafter(tmp_path / "packed", tmp_path / "unpacked")
    original = mx.load(str(trained_dir / "model.safetensors"))
    unpacked = mx.load(str(tmp_path / "unpacked" / "model.safetensors"))
    assert {k: v.shape for k, v in unpacked.items()} == {k: v.shape for k, v in original.items()}
    assert all(v.dtype == mx.bfloat16 for v in unpacked.values())
    assert json.loads((tmp_path / "unpacked" / "config.json").read_text()) == json.loads(
        (trained_dir / "config.json").read_text())
    packed, again = load_drafter(tmp_path / "packed", tiny_llama), load_drafter(tmp_path / "unpacked", tiny_llama)
    ctx = tiny_llama.model(mx.array([[7, 8, 9, 10]]), tap_layers=packed.tap_layers).taps
    block = mx.array([[11] + [MASK_ID] * (BLOCK - 1)])
    ours, theirs = again.hidden(block, ctx, again.make_cache()), packed.hidden(block, ctx, packed.make_cache())
    assert mx.abs(ours - theirs).max().item() < 0.01 * mx.abs(theirs).max().item()  # bf16 rounding of the unpacked weights
    with pytest.raises(CheckpointError, match="not packed"):
        unpack_drafter(trained_dir, tmp_path / "twice")


def test_a_packed_drafter_missing_a_bias_names_the_tensor(trained_dir: Path, tiny_llama: LoadedModel,
                                                          tmp_path: Path) -> None:
    from runtime.training.pack import pack_drafter

    pack_drafter(trained_dir, tmp_path / "packed")
    weights = mx.load(str(tmp_path / "packed" / "model.safetensors"))
    del weights["fc.biases"]
    mx.save_safetensors(str(tmp_path / "packed" / "model.safetensors"), weights)
    with pytest.raises(CheckpointError, match=r"missing tensor fc\.biases"):
        load_drafter(tmp_path / "packed", tiny_llama)


def test_a_grown_drafter_first_drafts_as_its_init_then_trains_its_new_layers(
        trained_dir: Path, tiny_llama_dir: Path, tiny_llama: LoadedModel, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWhat is two plus two?\nTell me about foxes.\n")

    def grow(out: str, lr: str) -> Path:
        train_cli.main([
            "--model", str(tiny_llama_dir), "--init", str(trained_dir), "--grow-to", "3", "--out", str(tmp_path / out),
            "--data", str(prompts), "--samples", "3", "--max-new-tokens", "24", "--epochs", "1", "--batch-size", "2",
            "--micro-batch", "2", "--anchors-per-seq", "8", "--cache-dir", str(tmp_path / "cache"),
            "--heldout-fraction", "0", "--no-compile", "--lr", lr,
        ])
        return tmp_path / out

    still, moved = grow("still", "0"), grow("moved", "1e-2")
    assert json.loads((still / "config.json").read_text())["num_hidden_layers"] == 3
    start, same, trained = (load_drafter(d, tiny_llama) for d in (trained_dir, still, moved))
    assert len(same.layers) == 3 and len(start.layers) == 2
    ctx = tiny_llama.model(mx.array([[7, 8, 9, 10]]), tap_layers=start.tap_layers).taps
    block = mx.array([[11] + [MASK_ID] * (BLOCK - 1)])
    hidden = [d.hidden(block, ctx, d.make_cache()) for d in (start, same, trained)]
    assert mx.allclose(hidden[0], hidden[1], atol=1e-2).item()  # the added layer adds nothing yet (bf16 export)
    assert not mx.allclose(hidden[0], hidden[2], atol=1e-2).item()
    weights = {d: mx.load(str(d / "model.safetensors")) for d in (still, moved)}
    assert mx.abs(weights[still]["layers.2.mlp.down_proj.weight"]).max().item() == 0
    assert mx.abs(weights[moved]["layers.2.mlp.down_proj.weight"]).max().item() > 0  # training moved it


def test_a_drafter_given_more_taps_first_drafts_as_its_init_then_trains_them(
        trained_dir: Path, tiny_llama_dir: Path, tiny_llama: LoadedModel, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWhat is two plus two?\nTell me about foxes.\n")
    wider = (0, *TAPS)  # the init's taps move one place along fc's input

    def widen(out: str, lr: str) -> Path:
        train_cli.main([
            "--model", str(tiny_llama_dir), "--init", str(trained_dir), "--taps", *map(str, wider),
            "--out", str(tmp_path / out), "--data", str(prompts), "--samples", "3", "--max-new-tokens", "24",
            "--epochs", "1", "--batch-size", "2", "--micro-batch", "2", "--anchors-per-seq", "8",
            "--cache-dir", str(tmp_path / "cache"), "--heldout-fraction", "0", "--no-compile", "--lr", lr,
        ])
        return tmp_path / out

    still, moved = widen("still", "0"), widen("moved", "1e-2")
    assert json.loads((still / "config.json").read_text())["dflash_config"]["target_layer_ids"] == list(wider)
    start, same, trained = (load_drafter(d, tiny_llama) for d in (trained_dir, still, moved))
    assert same.tap_layers == wider
    prompt, block = mx.array([[7, 8, 9, 10]]), mx.array([[11] + [MASK_ID] * (BLOCK - 1)])
    hidden = [d.hidden(block, tiny_llama.model(prompt, tap_layers=d.tap_layers).taps, d.make_cache())
              for d in (start, same, trained)]
    assert mx.allclose(hidden[0], hidden[1], atol=1e-2).item()  # the added tap is read through zeros (bf16 export)
    assert not mx.allclose(hidden[0], hidden[2], atol=1e-2).item()
    width = tiny_llama.model.args.hidden_size
    fc = {d: mx.load(str(d / "model.safetensors"))["fc.weight"] for d in (still, moved)}
    assert mx.abs(fc[still][:, :width]).max().item() == 0
    assert mx.abs(fc[moved][:, :width]).max().item() > 0  # training moved the added tap's columns


def test_more_taps_must_keep_the_init_drafters_taps(trained_dir: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"list the drafter's taps \[1, 2\]"):
        train_cli.main(["--model", str(tiny_llama_dir), "--init", str(trained_dir), "--taps", "0", "1",
                        "--out", str(tmp_path / "out"), "--data", "missing.txt", "--samples", "1"])


def test_a_finished_run_refuses_to_restart_without_resume(trained_dir: Path, tiny_llama_dir: Path) -> None:
    with pytest.raises(Exception, match="--resume"):
        train_cli.main(["--model", str(tiny_llama_dir), "--out", str(trained_dir), "--data", "missing.txt",
                        "--samples", "1", "--block-size", str(BLOCK), "--layers", "2", "--taps", *map(str, TAPS),
                        "--mask-token-id", str(MASK_ID), "--cache-dir", str(trained_dir / "cache")])


def test_exported_drafter_runs_the_same_in_official_dflash(trained_dir: Path, tiny_llama: LoadedModel) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("dflash")
    from .reference.dflash_torch_reference import reference_drafter_hidden

    drafter = load_drafter(trained_dir, tiny_llama)
    ctx = tiny_llama.model(mx.array([[7, 8, 9, 10, 11]]), tap_layers=drafter.tap_layers).taps
    block = [12] + [MASK_ID] * (BLOCK - 1)
    ours = np.array(drafter.hidden(mx.array([block]), ctx, drafter.make_cache()))
    noise = np.array(tiny_llama.model.embed(mx.array(block)))
    official = reference_drafter_hidden(str(trained_dir), noise, np.array(ctx[0]), np.arange(5 + BLOCK))
    np.testing.assert_allclose(ours, official, atol=1e-4)  # every tensor loaded, none left at random init


def test_training_can_start_from_an_existing_drafter(trained_dir: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--init continues a drafter: its shape and weights are the start (with lr 0 the output is the input)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Hello there\nWhat is two plus two?\nTell me about foxes.\n")
    out = tmp_path / "more"
    train_cli.main([
        "--model", str(tiny_llama_dir), "--init", str(trained_dir), "--out", str(out), "--data", str(prompts),
        "--samples", "3", "--max-new-tokens", "24", "--epochs", "1", "--batch-size", "2", "--micro-batch", "2",
        "--anchors-per-seq", "8", "--cache-dir", str(tmp_path / "cache"), "--heldout-fraction", "0", "--no-compile",
        "--lr", "0",  # no update: the output must be the initial drafter itself
    ])
    assert json.loads((out / "config.json").read_text()) == json.loads((trained_dir / "config.json").read_text())
    before, after = mx.load(str(trained_dir / "model.safetensors")), mx.load(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    for name in before:
        assert mx.array_equal(before[name], after[name]), name


def test_averaged_drafters_weigh_each_tensor_and_widen_the_narrower_taps(tmp_path: Path, tiny_llama: LoadedModel) -> None:
    """A drafter tapping layers 1, 2 averaged with one tapping 0, 1, 2: the narrower one's fc
    columns land at its taps' places (zeros at the added tap) before the weighted mean."""
    target = fixtures.tiny_config("llama")
    narrow_config, wide_config = (fixtures.drafter_config(target, block_size=BLOCK, taps=t) for t in ([1, 2], [0, 1, 2]))
    narrow_w, wide_w = fixtures.drafter_weights(narrow_config, seed=1), fixtures.drafter_weights(wide_config, seed=2)
    narrow = fixtures.drafter_folder(tmp_path / "narrow", narrow_config, narrow_w)
    wide = fixtures.drafter_folder(tmp_path / "wide", wide_config, wide_w)
    config, averaged = average_drafters(narrow, wide, weight=0.25)
    assert config["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    bf16 = lambda a: np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32))  # noqa: E731  (as stored)
    h = target["hidden_size"]
    widened = np.concatenate([np.zeros((h, h), np.float32), bf16(narrow_w["fc.weight"])], axis=1)
    np.testing.assert_allclose(np.array(averaged["fc.weight"].astype(mx.float32)),
                               0.25 * widened + 0.75 * bf16(wide_w["fc.weight"]), atol=1e-2)
    name = "layers.0.mlp.down_proj.weight"
    np.testing.assert_allclose(np.array(averaged[name].astype(mx.float32)),
                               0.25 * bf16(narrow_w[name]) + 0.75 * bf16(wide_w[name]), atol=1e-2)
    soup = write_z_lab_folder(tmp_path / "soup", averaged, config, "bfloat16")
    assert load_drafter(soup, tiny_llama).tap_layers == (0, 1, 2)  # the runtime loads and binds it


def test_drafters_whose_taps_neither_hold_the_others_are_not_averaged(tmp_path: Path) -> None:
    target = fixtures.tiny_config("llama")
    folders = []
    for name, taps in (("a", [0, 1]), ("b", [1, 2])):
        config = fixtures.drafter_config(target, block_size=BLOCK, taps=taps)
        folders.append(fixtures.drafter_folder(tmp_path / name, config, fixtures.drafter_weights(config)))
    with pytest.raises(CheckpointError, match="neither holds the other's taps"):
        average_drafters(*folders)
