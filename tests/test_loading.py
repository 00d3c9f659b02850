"""Every checkpoint format loads, gives the logits it should, and bad input is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from runtime.errors import CheckpointError, UnsupportedArchitectureError
from runtime.loading import load_target

from . import fixtures

PROMPT = [[5, 17, 42, 99, 3, 250, 7, 11]]


def reference_logits(config: dict, weights: dict[str, np.ndarray], tokens: list[list[int]]) -> np.ndarray:
    """An independent float64 numpy forward of the Llama/Qwen3 architecture."""
    x = weights["model.embed_tokens.weight"][np.array(tokens[0])].astype(np.float64)
    nq, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps, theta, n = config["rms_norm_eps"], config["rope_theta"], x.shape[0]

    def rms(v: np.ndarray, w: np.ndarray) -> np.ndarray:
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w

    inv = theta ** (-np.arange(0, hd, 2) / hd)
    ang = np.arange(n)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(t: np.ndarray) -> np.ndarray:  # t [heads, n, hd]
        half = hd // 2
        rot = np.concatenate([-t[..., half:], t[..., :half]], -1)
        return t * cos + rot * sin

    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = rms(x, weights[p + "input_layernorm.weight"])
        q = (a @ weights[p + "self_attn.q_proj.weight"].T).reshape(n, nq, hd).transpose(1, 0, 2)
        k = (a @ weights[p + "self_attn.k_proj.weight"].T).reshape(n, nkv, hd).transpose(1, 0, 2)
        v = (a @ weights[p + "self_attn.v_proj.weight"].T).reshape(n, nkv, hd).transpose(1, 0, 2)
        if config["model_type"] == "qwen3":
            q, k = rms(q, weights[p + "self_attn.q_norm.weight"]), rms(k, weights[p + "self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, nq // nkv, 0), np.repeat(v, nq // nkv, 0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((n, n), -np.inf), 1)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        x = x + o.transpose(1, 0, 2).reshape(n, nq * hd) @ weights[p + "self_attn.o_proj.weight"].T
        m = rms(x, weights[p + "post_attention_layernorm.weight"])
        g, u = m @ weights[p + "mlp.gate_proj.weight"].T, m @ weights[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ weights[p + "mlp.down_proj.weight"].T
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    return rms(x, weights["model.norm.weight"]) @ head.T


def mlx_logits(path: Path, dtype: str = "float32") -> np.ndarray:
    loaded = load_target(path, dtype=dtype)
    return np.array(loaded.model(mx.array(PROMPT)).logits[0].astype(mx.float32))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hf_folder_logits_match_independent_numpy_forward(tmp_path: Path, family: str) -> None:
    config = fixtures.tiny_config(family)
    weights = fixtures.random_weights(config, seed=3)
    got = mlx_logits(fixtures.hf_folder(tmp_path / family, config, weights))
    np.testing.assert_allclose(got, reference_logits(config, weights, PROMPT), atol=2e-4, rtol=1e-4)


def test_sharded_hf_folder_with_index_loads_the_same_weights(tmp_path: Path) -> None:
    config = fixtures.tiny_config("qwen3")
    weights = fixtures.random_weights(config, seed=4)
    folder = fixtures.hf_folder(tmp_path / "sharded", config, weights)
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        mx.save_safetensors(str(folder / shard), {k: mx.array(weights[k]) for k in keys})
    index = {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    np.testing.assert_allclose(mlx_logits(folder), reference_logits(config, weights, PROMPT), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_hf_folder_loads_and_tracks_float32(tmp_path: Path, dtype: str) -> None:
    config = fixtures.tiny_config("llama")
    weights = fixtures.random_weights(config, seed=5)
    folder = fixtures.hf_folder(tmp_path / dtype, config, weights)
    half = {k: mx.array(v).astype(getattr(mx, dtype)) for k, v in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), half)
    loaded = load_target(folder, dtype="native")
    assert loaded.compute_dtype == dtype
    got = np.array(loaded.model(mx.array(PROMPT)).logits[0].astype(mx.float32))
    want = reference_logits(config, weights, PROMPT)
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_mlx_quantized_folder_equals_its_dequantized_weights(tmp_path: Path) -> None:
    config = fixtures.tiny_config("llama", tie_word_embeddings=False)
    weights = fixtures.random_weights(config, seed=6)
    folder = fixtures.mlx_quantized_folder(tmp_path / "q4", config, weights)
    want = reference_logits(config, fixtures.dequantized_like_mlx(weights), PROMPT)
    np.testing.assert_allclose(mlx_logits(folder, "float32"), want, atol=2e-4, rtol=1e-4)
    native = load_target(folder, dtype="native")  # stays packed: quantized matmuls
    assert native.quantized
    got = np.array(native.model(mx.array(PROMPT)).logits[0])
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F32"])
def test_gguf_file_equals_the_weights_it_holds(tmp_path: Path, qtype: str) -> None:
    config = fixtures.tiny_config("llama")
    weights = fixtures.random_weights(config, seed=7)
    path, held = fixtures.gguf_file(tmp_path / f"tiny-{qtype}.gguf", config, weights, qtype=qtype)
    np.testing.assert_allclose(mlx_logits(path), reference_logits(config, held, PROMPT), atol=2e-4, rtol=1e-4)


def test_gguf_and_hf_folder_holding_the_same_weights_agree(tmp_path: Path) -> None:
    config = fixtures.tiny_config("llama")
    path, held = fixtures.gguf_file(tmp_path / "same.gguf", config, fixtures.random_weights(config, seed=8))
    folder = fixtures.hf_folder(tmp_path / "same", config, held)
    np.testing.assert_allclose(mlx_logits(path), mlx_logits(folder), atol=1e-5, rtol=1e-5)
    gguf_tok = load_target(path).tokenizer
    assert gguf_tok.encode("def add(a, b):") == load_target(folder).tokenizer.encode("def add(a, b):")


@pytest.mark.parametrize("qtype", ["Q5_0", "TQ1_0"])  # MLX errors on the first, skips the second
def test_unsupported_gguf_tensor_type_is_refused_by_name(tmp_path: Path, qtype: str) -> None:
    config = fixtures.tiny_config("llama", intermediate_size=256, hidden_size=256, head_dim=64)
    weights = fixtures.random_weights(config, seed=9)
    path, _ = fixtures.gguf_file(tmp_path / "k.gguf", config, weights,
                                 override_types={"model.layers.0.mlp.up_proj.weight": qtype})
    with pytest.raises(CheckpointError, match=rf"blk\.0\.ffn_up\.weight \({qtype}\).*re-quantize"):
        load_target(path)


def _edit_weights(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    tensors = dict(mx.load(str(folder / "model.safetensors")))
    edit(tensors)
    mx.save_safetensors(str(folder / "model.safetensors"), tensors)


@pytest.fixture
def scratch_llama(tmp_path: Path, tiny_llama_dir: Path) -> Path:
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "copy"))


def test_missing_tensor_is_named(scratch_llama: Path) -> None:
    _edit_weights(scratch_llama, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.2\.mlp\.up_proj\.weight"):
        load_target(scratch_llama)


def test_extra_tensor_is_named(scratch_llama: Path) -> None:
    _edit_weights(scratch_llama, lambda t: t.update({"model.layers.0.mystery.weight": mx.zeros((4,))}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*mystery"):
        load_target(scratch_llama)


def test_misshaped_tensor_is_named_with_both_shapes(scratch_llama: Path) -> None:
    _edit_weights(scratch_llama, lambda t: t.update({"model.norm.weight": mx.ones((63,))}))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(63,\).*\(64,\)"):
        load_target(scratch_llama)


def test_unknown_architecture_is_refused_with_the_supported_list(scratch_llama: Path) -> None:
    config = json.loads((scratch_llama / "config.json").read_text())
    config.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (scratch_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM"):
        load_target(scratch_llama)


def test_missing_config_field_is_named(scratch_llama: Path) -> None:
    config = json.loads((scratch_llama / "config.json").read_text())
    del config["intermediate_size"]
    (scratch_llama / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="intermediate_size"):
        load_target(scratch_llama)


def test_missing_weights_and_missing_paths_say_what_to_give(tmp_path: Path, scratch_llama: Path) -> None:
    (scratch_llama / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_target(scratch_llama)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_target(tmp_path / "nowhere")
