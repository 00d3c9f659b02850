"""The decoder forward: taps, caches, trimming, and the context limit."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from protocol import GenerationParams
from runtime.cache import StackedKVCache
from runtime.errors import ContextLengthError
from runtime.loading import LoadedModel, load_drafter, load_target
from runtime.plain import generate_plain, run_to_end

from . import fixtures

TOKENS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def test_trimming_the_cache_and_forwarding_again_reproduces_an_uncut_forward(tiny_llama: LoadedModel) -> None:
    model = tiny_llama.model
    full = model(mx.array([TOKENS])).logits[0]
    cache = model.make_cache()
    model(mx.array([TOKENS[:6] + [7, 7, 7]]), cache)  # three wrong tokens ...
    for layer in cache:
        assert layer.trim(3) == 3  # ... trimmed away
    rest = model(mx.array([TOKENS[6:]]), cache).logits[0]
    np.testing.assert_allclose(np.array(rest), np.array(full[6:]), atol=1e-4, rtol=1e-4)
    assert cache[0].offset == len(TOKENS)


def test_incremental_decoding_matches_one_full_forward(tiny_llama: LoadedModel) -> None:
    model = tiny_llama.model
    full = np.array(model(mx.array([TOKENS])).logits[0])
    cache = model.make_cache()
    steps = [np.array(model(mx.array([[t]]), cache).logits[0, 0]) for t in TOKENS]
    np.testing.assert_allclose(np.stack(steps), full, atol=1e-4, rtol=1e-4)


def test_taps_are_layer_outputs_concatenated_in_requested_order(tiny_llama: LoadedModel) -> None:
    model = tiny_llama.model
    out = model(mx.array([TOKENS]), tap_layers=(2, 0))
    h = model.embed(mx.array([TOKENS]))
    outputs = []
    for layer in model.model.layers:
        h = layer(h, None)
        outputs.append(h)
    want = mx.concatenate([outputs[2], outputs[0]], axis=-1)
    assert out.taps is not None and out.taps.shape == (1, len(TOKENS), 2 * model.args.hidden_size)
    np.testing.assert_allclose(np.array(out.taps), np.array(want), atol=1e-6)


def test_prompt_longer_than_the_context_is_refused_with_advice(tiny_llama: LoadedModel) -> None:
    limit = tiny_llama.model.args.max_position_embeddings
    with pytest.raises(ContextLengthError, match="shorten the prompt or lower max_tokens"):
        list(generate_plain(tiny_llama.model, tiny_llama.tokenizer, [5] * (limit - 3), GenerationParams(max_tokens=4)))


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_llama: LoadedModel) -> None:
    def run(seed: int) -> list[int]:
        params = GenerationParams(max_tokens=24, temperature=3.0, top_p=0.95, top_k=100, seed=seed)
        return run_to_end(generate_plain(tiny_llama.model, tiny_llama.tokenizer, TOKENS, params), len(TOKENS)).token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_max_tokens_and_stop_strings_end_plain_generation(tiny_llama: LoadedModel) -> None:
    tok = tiny_llama.tokenizer
    free = run_to_end(generate_plain(tiny_llama.model, tok, TOKENS, GenerationParams(max_tokens=12)), len(TOKENS))
    assert free.finish_reason in ("length", "stop") and len(free.token_ids) <= 12
    if free.finish_reason == "length" and len(free.text) > 4:
        stop = free.text[2:4]
        cut = run_to_end(generate_plain(tiny_llama.model, tok, TOKENS, GenerationParams(max_tokens=12, stop=(stop,))), len(TOKENS))
        assert cut.finish_reason == "stop"
        assert cut.text == free.text[: free.text.find(stop)]


def test_device_length_cache_matches_host_trimmed_cache(tiny_llama: LoadedModel) -> None:
    """Writes at a device-side length, keeps a prefix lazily, and never attends the rest."""
    model = tiny_llama.model
    host, device = model.make_cache(), model.make_device_cache()
    for chunk, keep in (([3, 14, 15, 92], 4), ([65, 35, 7, 7, 7], 2), ([89, 79, 32], 1), ([38, 11], 2)):
        want = model(mx.array([chunk]), host).logits[0]
        got = model(mx.array([chunk]), device).logits[0]
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)
        for layer in host:
            layer.trim(len(chunk) - keep)
        for layer in device:
            layer.advance(mx.array(keep))
    assert device[0].bound == 14  # every write could have been kept
    for layer in device:
        for kept in (4, 6, 7, 9):  # the host learns each round's length, oldest first
            layer.settle(kept)
    assert int(device[0].length.item()) == host[0].offset == device[0].bound == 9


def test_a_stacked_forward_gives_each_request_the_logits_of_its_own_forward(tiny_llama: LoadedModel) -> None:
    """Requests at different KV lengths share one forward: each row writes, ropes and attends at its own length."""
    model = tiny_llama.model
    prompts = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32]]
    alone, shared = [], []
    for prompt in prompts:  # each request prefilled alone, in two copies of its cache
        for caches in (alone, shared):
            cache = model.make_device_cache()
            model(mx.array([prompt]), cache)
            for layer in cache:
                layer.advance(mx.array(len(prompt)))
            caches.append(cache)
    block = mx.array([[7, 8, 9], [10, 11, 12], [13, 14, 15]])
    stacked = [StackedKVCache(layers, block.shape[1]) for layers in zip(*shared)]
    batched = model(block, stacked).logits
    for layer in stacked:
        layer.count_writes([block.shape[1]] * len(prompts))
        layer.release_rows(range(len(prompts)))
    for row, cache in enumerate(alone):
        want = model(block[row : row + 1], cache).logits[0]
        np.testing.assert_allclose(np.array(batched[row]), np.array(want), atol=1e-5, rtol=1e-5)
        # the request's own cache got its row back: the next forward continues from it
        assert int(shared[row][0].length.item()) == len(prompts[row]) and shared[row][0].bound == len(prompts[row]) + 3


DRAFTER_VARIANTS = {
    "full": {},
    "sliding_causal": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "use_sliding_window": True},
    "all_causal": {"is_causal": True},
    "window_bidirectional": {"layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 3,
                             "use_sliding_window": True, "is_causal": False},
}


@pytest.mark.parametrize("variant", sorted(DRAFTER_VARIANTS))
def test_a_stacked_draft_with_shorter_blocks_gives_each_request_its_own_drafts(
        tiny_llama: LoadedModel, tmp_path: Path, variant: str) -> None:
    """Rows with different contexts, kept rows and block sizes: padding past a row's block is never seen."""
    config = {**fixtures.drafter_config(fixtures.tiny_config("llama"), block_size=8), **DRAFTER_VARIANTS[variant]}
    tiny_drafter = load_drafter(fixtures.drafter_folder(tmp_path / "d", config, fixtures.drafter_weights(config)), tiny_llama)
    width = tiny_drafter.args.hidden_size * len(tiny_drafter.tap_layers)
    rng = np.random.default_rng(0)
    contexts = [mx.array(rng.standard_normal((1, n, width)).astype(np.float32)) for n in (6, 3, 9)]
    new_rows = mx.array(rng.standard_normal((3, 4, width)).astype(np.float32))
    keep, blocks = [4, 1, 2], [4, 2, 3]
    mask_id = tiny_drafter.args.mask_token_id

    def block_tokens(anchor: int, size: int) -> mx.array:
        return mx.array([[anchor] + [mask_id] * (size - 1)])

    alone, shared = [], []
    for ctx in contexts:
        for caches in (alone, shared):
            cache = tiny_drafter.make_device_cache()
            tiny_drafter.write_context(ctx, cache, None)
            caches.append(cache)
    want = [tiny_drafter.hidden(block_tokens(20 + r, blocks[r]), new_rows[r : r + 1], alone[r], keep=mx.array(keep[r]))[0]
            for r in range(3)]
    stacked = [StackedKVCache(layers, 4) for layers in zip(*shared)]
    tokens = mx.array([[20 + r] + [mask_id] * (max(blocks) - 1) for r in range(3)])  # padded to the longest block
    got = tiny_drafter.hidden(tokens, new_rows, stacked, keep=mx.array(keep), block_lens=mx.array(blocks))
    for r in range(3):
        np.testing.assert_allclose(np.array(got[r, : blocks[r]]), np.array(want[r]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family,quantized", [("llama", False), ("qwen3", False), ("llama", True)])
def test_fused_projections_give_the_unfused_logits(tmp_path: Path, family: str, quantized: bool) -> None:
    config = fixtures.tiny_config(family)
    weights = fixtures.random_weights(config)
    folder = (fixtures.mlx_quantized_folder if quantized else fixtures.hf_folder)(tmp_path / family, config, weights)
    fused, plain = load_target(folder, dtype="float32"), load_target(folder, dtype="float32", fuse=False)
    layer = fused.model.model.layers[0]
    assert "qkv_proj" in layer.self_attn and "gate_up_proj" in layer.mlp and "q_proj" not in layer.self_attn
    tokens = mx.array([[3, 17, 42, 5, 99, 7]])
    a = fused.model(tokens, fused.model.make_cache(), tap_layers=(0, 1)).logits
    b = plain.model(tokens, plain.model.make_cache(), tap_layers=(0, 1)).logits
    assert float(mx.abs(a - b).max()) < 1e-4


def test_a_fused_drafter_drafts_as_the_unfused_one_with_fewer_ops(tiny_llama: LoadedModel, tiny_drafter_dir: Path) -> None:
    from runtime.profile import op_counts

    fused, plain = load_drafter(tiny_drafter_dir, tiny_llama), load_drafter(tiny_drafter_dir, tiny_llama, fuse=False)
    assert "qkv_proj" in fused.layers[0].self_attn and "q_proj" in plain.layers[0].self_attn
    width = fused.args.hidden_size * len(fused.tap_layers)
    ctx = mx.array(np.random.default_rng(0).standard_normal((2, 5, width)).astype(np.float32))
    block = mx.array([[20] + [fused.args.mask_token_id] * 7, [21] + [fused.args.mask_token_id] * 7])
    hidden = [d.hidden(block, ctx, d.make_cache()) for d in (fused, plain)]
    ops = [sum(op_counts([h]).values()) for h in hidden]  # counted before the graphs are evaluated
    np.testing.assert_allclose(np.array(hidden[0]), np.array(hidden[1]), atol=1e-5, rtol=1e-5)
    assert ops[0] < ops[1]  # the point of fusing: a projection is one Matmul, not Transpose+Flatten+Matmul+Unflatten
