"""Random targets of published shapes (``--model random:qwen3-8b``): shapes, greedy behaviour, export."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from protocol import GenerationParams
from runtime.convert import export
from runtime.errors import CheckpointError
from runtime.loading import LoadedModel, load_checkpoint, load_target
from runtime.models import decoder_args
from runtime.plain import generate_plain, run_to_end
from runtime.random_targets import greedy_successor, published_config, random_checkpoint

# small enough for a CPU, deep enough that the layers' sum could bury the embedding
SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 12, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024}

# the published config.json figures (layers, hidden, FFN, heads, KV heads, head_dim, vocab, tied, RoPE theta)
PUBLISHED_SHAPES = {
    "qwen3-8b": (36, 4096, 12288, 32, 8, 128, 151936, False, 1e6),
    "qwen3-4b": (36, 2560, 9728, 32, 8, 128, 151936, True, 1e6),
    "llama-3.1-8b": (32, 4096, 14336, 32, 8, 128, 128256, False, 5e5),
}


def small_target(spec: str, dtype: str = "float32", seed: int = 0) -> LoadedModel:
    return load_checkpoint(random_checkpoint(spec, seed=seed, overrides=SMALL), dtype)


@pytest.mark.parametrize("name", sorted(PUBLISHED_SHAPES))
def test_random_targets_have_the_published_shapes(name: str) -> None:
    a = decoder_args(published_config(name))
    assert (a.num_hidden_layers, a.hidden_size, a.intermediate_size, a.num_attention_heads, a.num_key_value_heads,
            a.head_dim, a.vocab_size, a.tie_word_embeddings, a.rope_theta) == PUBLISHED_SHAPES[name]
    if name.startswith("llama"):
        assert a.rope_scaling is not None and a.rope_scaling["rope_type"] == "llama3"


def test_a_quantized_random_target_packs_every_matrix_as_mlx_community_does() -> None:
    ckpt = random_checkpoint("random:qwen3-8b-4bit", overrides=SMALL)
    matrices = [n for n, t in ckpt.tensors.items() if n.endswith(".weight") and t.dtype == mx.uint32]
    assert len(matrices) == 1 + 7 * SMALL["num_hidden_layers"] + 1  # embedding, 7 per layer, LM head
    assert {(s.group_size, s.bits) for s in ckpt.quantized.values()} == {(64, 4)}
    assert ckpt.config["quantization"] == {"group_size": 64, "bits": 4}


@pytest.mark.parametrize("spec,dtype", [("random:qwen3-8b", "float32"), ("random:qwen3-8b", "bfloat16"),
                                        ("random:llama-3.1-8b-4bit", "native"), ("random:qwen3-4b-8bit", "native")])
def test_greedy_decoding_of_a_random_target_follows_its_successor(spec: str, dtype: str) -> None:
    target = small_target(spec, dtype)
    prompt = target.tokenizer.encode("def add(a, b):\n    return")
    result = run_to_end(generate_plain(target.model, target.tokenizer, prompt, GenerationParams(max_tokens=24)), len(prompt))
    successor = greedy_successor(target.config)
    chain = [int(successor[prompt[-1]])]
    while len(chain) < 24:
        chain.append(int(successor[chain[-1]]))
    assert result.token_ids == chain  # no EOS either: it ran to max_tokens
    assert result.finish_reason == "length"
    if not target.config["tie_word_embeddings"]:
        assert len(set(chain)) > 20  # a permutation's walk, not one token repeated


def test_seeds_give_different_random_targets() -> None:
    a, b = random_checkpoint("random:qwen3-8b", seed=0, overrides=SMALL), random_checkpoint("random:qwen3-8b", seed=1, overrides=SMALL)
    assert not np.array_equal(greedy_successor(a.config), greedy_successor(b.config))
    assert not mx.array_equal(a.tensors["lm_head.weight"], b.tensors["lm_head.weight"])


def test_an_unknown_random_target_names_the_known_ones() -> None:
    with pytest.raises(CheckpointError, match="random:qwen3-8b"):
        load_target("random:gpt-5")
    with pytest.raises(CheckpointError, match="no such random target"):
        load_target("random:qwen3-8b-3bit")


def test_greedy_successor_is_refused_for_a_trained_target(tiny_llama: LoadedModel) -> None:
    with pytest.raises(CheckpointError, match="not built by runtime.random_targets"):
        greedy_successor(tiny_llama.config)


def test_a_converted_quantized_random_target_reloads_as_the_same_model(tmp_path: Path) -> None:
    target = load_checkpoint(random_checkpoint("random:qwen3-8b-4bit", overrides=SMALL), "native", fuse=False)
    export(target, tmp_path)
    again = load_target(tmp_path, dtype="native", fuse=False)
    assert again.quantized and again.format == "mlx-quantized"
    tokens = mx.array([target.tokenizer.encode("hello world")])
    assert mx.array_equal(target.model(tokens).logits, again.model(tokens).logits)
    assert again.tokenizer.decode([104, 105, 1000]) == target.tokenizer.decode([104, 105, 1000]) == "hi<|t1000|>"
    assert np.array_equal(greedy_successor(again.config), greedy_successor(target.config))
