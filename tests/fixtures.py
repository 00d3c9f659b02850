"""Tiny random-weight checkpoints, written by the tests in every supported format.

Each writer takes the same float32 weights (HF names) so formats can be compared:
``hf_llama``/``hf_qwen3`` write them as they are, ``mlx_quantized`` packs the linear
layers with ``mx.quantize``, and ``gguf_llama`` writes a llama.cpp-style GGUF (Q/K rows
permuted as llama.cpp's converter does, linear layers in Q4_1 or Q8_0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts a block of tokens and verifies it in one pass.",
    "café, naïve, über, 日本語, emoji 🎉",
] * 4


def tiny_config(family: str = "llama", **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if family == "llama" else "Qwen3ForCausalLM"],
        "model_type": family,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 320,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": family == "llama",
        "eos_token_id": EOS_ID,
    }
    config.update(overrides)
    return config


def random_weights(config: dict[str, Any], seed: int = 0, scale: float = 0.25) -> dict[str, np.ndarray]:
    """float32 weights under HF names; the scale makes layers matter (greedy output varies)."""
    rng = np.random.default_rng(seed)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd, nq, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": (rng.standard_normal((v, h)) * 0.5).astype(np.float32),
         "model.norm.weight": norm(h)}
    if not config.get("tie_word_embeddings"):
        w["lm_head.weight"] = mat(v, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(nq * hd, h)
        w[p + "self_attn.k_proj.weight"] = mat(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = mat(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, nq * hd)
        w[p + "mlp.gate_proj.weight"] = mat(f, h)
        w[p + "mlp.up_proj.weight"] = mat(f, h)
        w[p + "mlp.down_proj.weight"] = mat(h, f)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if config["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
    return w


def train_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE of exactly ``vocab_size`` entries, trained on a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 8, trainer)
    assert tok.get_vocab_size() <= vocab_size
    return tok


def write_tokenizer_files(folder: Path, vocab_size: int) -> None:
    train_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False,
    }))


def save_safetensors(folder: Path, tensors: dict[str, np.ndarray | mx.array]) -> None:
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})


def hf_folder(folder: Path, config: dict[str, Any], weights: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_safetensors(folder, weights)
    write_tokenizer_files(folder, config["vocab_size"])
    return folder


def mlx_quantized_folder(folder: Path, config: dict[str, Any], weights: dict[str, np.ndarray],
                         group_size: int = 32, bits: int = 4) -> Path:
    """Linear layers and the embedding packed as mlx-community publishes them."""
    packed: dict[str, mx.array] = {}
    for name, value in weights.items():
        if value.ndim == 2:
            w, s, b = mx.quantize(mx.array(value), group_size=group_size, bits=bits)
            layer = name[: -len(".weight")]
            packed.update({f"{layer}.weight": w, f"{layer}.scales": s, f"{layer}.biases": b})
        else:
            packed[name] = mx.array(value)
    config = dict(config, quantization={"group_size": group_size, "bits": bits})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_safetensors(folder, packed)
    write_tokenizer_files(folder, config["vocab_size"])
    return folder


def dequantized_like_mlx(weights: dict[str, np.ndarray], group_size: int = 32, bits: int = 4) -> dict[str, np.ndarray]:
    """What ``mlx_quantized_folder`` stores, unpacked: the weights an exact loader must see."""
    out = {}
    for name, value in weights.items():
        if value.ndim == 2:
            w, s, b = mx.quantize(mx.array(value), group_size=group_size, bits=bits)
            out[name] = np.array(mx.dequantize(w, s, b, group_size=group_size, bits=bits))
        else:
            out[name] = value
    return out


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    if hf.startswith("model.layers."):
        _, _, idx, rest = hf.split(".", 3)
        module, suffix = rest.rsplit(".", 1)
        return f"blk.{idx}.{GGUF_NAMES[module]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows (so the loader's inverse is exercised)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_file(path: Path, config: dict[str, Any], weights: dict[str, np.ndarray], qtype: str = "Q4_1",
              override_types: dict[str, str] | None = None) -> tuple[Path, dict[str, np.ndarray]]:
    """Write a llama GGUF; returns it with the float32 weights it really holds (after quantization)."""
    import gguf

    tok = json.loads(train_tokenizer(config["vocab_size"]).to_str())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    tokens += [f"<unused{i}>" for i in range(config["vocab_size"] - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_eos_token_id(EOS_ID)
    writer.add_bos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    held: dict[str, np.ndarray] = {}
    for name, value in weights.items():
        kind = (override_types or {}).get(name, qtype if value.ndim == 2 else "F32")
        stored = value
        if name.endswith("q_proj.weight"):
            stored = llama_cpp_permute(value, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            stored = llama_cpp_permute(value, config["num_key_value_heads"])
        qt = getattr(gguf.GGMLQuantizationType, kind)
        data = stored if kind == "F32" else _quantize_or_random_bytes(stored, qt)
        writer.add_tensor(gguf_name(name), data, raw_dtype=qt)
        if kind in ("F32", "Q4_0", "Q4_1", "Q8_0"):
            held[name] = value if kind == "F32" else _unpermuted_roundtrip(name, stored, data, qt, config)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, held


def _quantize_or_random_bytes(values: np.ndarray, qt: Any) -> np.ndarray:
    """gguf-py cannot quantize every type (K-quants); random bytes of the right size stand in."""
    import gguf

    try:
        return gguf.quants.quantize(values, qt)
    except NotImplementedError:
        shape = gguf.quants.quant_shape_to_byte_shape(values.shape, qt)
        return np.random.default_rng(0).integers(0, 256, size=shape, dtype=np.uint8)


def _unpermuted_roundtrip(name: str, stored: np.ndarray, data: np.ndarray, qt: Any, config: dict[str, Any]) -> np.ndarray:
    import gguf

    back = gguf.quants.dequantize(data, qt).reshape(stored.shape).astype(np.float32)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for proj, n in heads.items():
        if name.endswith(f"{proj}.weight"):
            rows = back.shape[0]
            back = back.reshape(n, rows // n // 2, 2, *back.shape[1:]).swapaxes(1, 2).reshape(back.shape)
    return back


def drafter_config(target: dict[str, Any], layers: int = 2, block_size: int = 16,
                   taps: list[int] | None = None, mask_token_id: int = 5) -> dict[str, Any]:
    """A z-lab-format DFlash drafter config for ``target``."""
    taps = taps if taps is not None else [1, target["num_hidden_layers"] - 2]
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": target["hidden_size"], "intermediate_size": 96, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rms_norm_eps": 1e-6, "rope_theta": target["rope_theta"], "vocab_size": target["vocab_size"],
        "max_position_embeddings": target["max_position_embeddings"], "block_size": block_size,
        "num_target_layers": target["num_hidden_layers"],
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": mask_token_id, "block_size": block_size},
    }


def drafter_weights(config: dict[str, Any], seed: int = 0, scale: float = 0.08) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f = config["hidden_size"], config["intermediate_size"]
    hd, nq, nkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    n_taps = len(config["dflash_config"]["target_layer_ids"])

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"fc.weight": mat(h, n_taps * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({
            p + "self_attn.q_proj.weight": mat(nq * hd, h), p + "self_attn.k_proj.weight": mat(nkv * hd, h),
            p + "self_attn.v_proj.weight": mat(nkv * hd, h), p + "self_attn.o_proj.weight": mat(h, nq * hd),
            p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
            p + "mlp.gate_proj.weight": mat(f, h), p + "mlp.up_proj.weight": mat(f, h),
            p + "mlp.down_proj.weight": mat(h, f),
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
        })
    return w


def drafter_folder(folder: Path, config: dict[str, Any], weights: dict[str, np.ndarray]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: mx.array(v).astype(mx.bfloat16) for k, v in weights.items()})
    return folder


def dflash2_config(target: dict[str, Any], layers: int = 2, block_size: int = 8, kernel: int = 3, group: int = 16,
                   rank: int = 8, top_k: int = 6, **kwargs: Any) -> dict[str, Any]:
    """A z-lab-format DFlash 2 drafter config for ``target``: DFlash 1's, plus the convolution and selector sizes."""
    config = drafter_config(target, layers=layers, block_size=block_size, **kwargs)
    config["architectures"] = ["DFlash2DraftModel"]
    config["dflash_config"].update(conv_kernel_size=kernel, conv_group_size=group, selector_rank=rank,
                                   selector_top_k=top_k)
    return config


def dflash2_weights(config: dict[str, Any], seed: int = 0, scale: float = 0.08) -> dict[str, np.ndarray]:
    """DFlash 1's weights plus each layer's two convolutions and the selector, under z-lab's names
    (the codebooks without ``.weight``)."""
    rng = np.random.default_rng(seed + 1)
    h, v, dflash = config["hidden_size"], config["vocab_size"], config["dflash_config"]
    kernel, groups, rank = dflash["conv_kernel_size"], h // dflash["conv_group_size"], dflash["selector_rank"]

    def rand(*shape: int, std: float = scale) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = drafter_weights(config, seed=seed, scale=scale)
    for i in range(config["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            w[f"layers.{i}.{conv}.base_kernel"] = rand(2, kernel, h, std=0.3)
            w[f"layers.{i}.{conv}.kernel_projection.weight"] = rand(2 * kernel * groups, h)
    w["candidate_selector.predecessor_codebook"] = rand(v, rank, std=0.5)
    w["candidate_selector.successor_codebook"] = rand(v, rank, std=0.5)
    w["candidate_selector.hidden_projection.weight"] = rand(rank, h, std=0.3)
    return w
