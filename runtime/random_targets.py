"""Targets with a published model's exact shape and random weights: ``--model random:qwen3-8b``.

A forward's cost depends on the shapes, the dtype and the quantization, not on what the
weights learned, so these targets measure the runtime at the sizes people run DFlash on
(4B-8B) where no trained weights can be downloaded. ``random:NAME`` builds NAME's published
config (layers, hidden, heads, KV heads, head_dim, vocab, RoPE) in the dtype asked;
``random:NAME-4bit`` (or ``-8bit``) quantizes every linear layer and the embedding as
mlx-community ships them (affine, group size 64).

The weights are random with one structure: the token embedding dominates the residual
stream and the LM head holds the embedding's rows permuted, so greedy decoding follows a
fixed random permutation of the vocabulary (the identity where embeddings are tied) with
logit margins far wider than any rounding. Outputs are then the same in every dtype and
engine mode, and an oracle drafter (``runtime.oracle``) can have exactly the number of
drafts accepted that it asks for. Every layer still runs at full cost.

The tokenizer is byte-level over the model's whole vocabulary: text encodes to byte tokens,
any other id decodes as ``<|tN|>``; it has no EOS, so a generation runs to max_tokens.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders, models, pre_tokenizers

from .errors import CheckpointError
from .loading import RANDOM_TARGET_PREFIX, Checkpoint, QuantSpec
from .models import build_model, decoder_args
from .tokenizer import Tokenizer

PREFIX = RANDOM_TARGET_PREFIX
QUANT_GROUP_SIZE = 64  # as mlx-community's 4-bit and 8-bit conversions
EMBED_SCALE = 32.0  # residual stream over the layers' sum: keeps the greedy successor decisive

_QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
          "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
          "rope_scaling": None, "rope_theta": 1000000.0, "vocab_size": 151936, "num_attention_heads": 32,
          "num_key_value_heads": 8, "num_hidden_layers": 36}

# the published config.json of each model (Hugging Face), the fields the runtime reads
PUBLISHED: dict[str, dict[str, Any]] = {
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "tie_word_embeddings": False},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "tie_word_embeddings": True},
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "vocab_size": 128256,
    },
}

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def parse_spec(spec: str) -> tuple[str, int | None]:
    """``random:qwen3-8b-4bit`` -> ("qwen3-8b", 4)."""
    match = re.fullmatch(rf"{PREFIX}(.+?)(?:-(4|8)bit)?", spec)
    name, bits = (match.group(1), match.group(2)) if match else ("", None)
    if name not in PUBLISHED:
        raise CheckpointError(f"--model {spec}: no such random target; known: "
                              f"{', '.join(PREFIX + n for n in sorted(PUBLISHED))} (add -4bit or -8bit to quantize)")
    return name, int(bits) if bits else None


def greedy_successor(config: dict[str, Any]) -> np.ndarray:
    """The token greedy decoding emits after each token, for a target built here (by its config)."""
    built = config.get("random_weights")
    if not built:
        raise CheckpointError("this target was not built by runtime.random_targets: its greedy successor is unknown")
    vocab = config["vocab_size"]
    if config.get("tie_word_embeddings"):
        return np.arange(vocab)
    return np.random.default_rng(built["seed"]).permutation(vocab)


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level BPE without merges: 256 byte tokens, then ``<|tN|>`` up to ``vocab_size``."""
    vocab = {c: i for i, c in enumerate(_byte_level_chars())}
    vocab.update({f"<|t{i}|>": i for i in range(len(vocab), vocab_size)})
    backend = _Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, vocab_size=vocab_size, bos_token_id=None, eos_token_ids=[], add_bos=False,
                     chat_template=CHATML)


def _byte_level_chars() -> list[str]:
    """The character byte-level BPE writes for each byte 0..255 (GPT-2's map: printable bytes
    are themselves, the others take the code points from 256 on, in byte order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def published_config(name: str, seed: int = 0, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**PUBLISHED[name], **(overrides or {}), "random_weights": {"preset": name, "seed": seed}}


def random_tensors(config: dict[str, Any], seed: int) -> dict[str, mx.array]:
    """The model's tensors under HF names (lazy): MLX's default initialisation, then the
    decisive embedding and LM head described above."""
    mx.random.seed(seed)
    tensors = dict(tree_flatten(build_model(decoder_args(config)).parameters()))
    embed = mx.random.normal(tensors["model.embed_tokens.weight"].shape)  # rows of norm ~sqrt(hidden)
    tensors["model.embed_tokens.weight"] = embed * EMBED_SCALE
    if "lm_head.weight" in tensors:
        # the head's row for successor[t] is token t's embedding: its logit after t is ~hidden,
        # every other logit ~N(0, sqrt(hidden))
        predecessor = np.argsort(greedy_successor(config))
        tensors["lm_head.weight"] = embed[mx.array(predecessor)]
    return tensors


def quantize_tensors(tensors: dict[str, mx.array], bits: int) -> dict[str, QuantSpec]:
    """Pack every 2-D weight (linear layers and the embedding) in place, as mlx-community does."""
    spec = QuantSpec(QUANT_GROUP_SIZE, bits)
    layers: dict[str, QuantSpec] = {}
    for name in [n for n, t in tensors.items() if n.endswith(".weight") and t.ndim == 2]:
        layer = name[: -len(".weight")]
        packed, scales, biases = mx.quantize(tensors[name], group_size=spec.group_size, bits=bits)
        tensors[name], tensors[f"{layer}.scales"], tensors[f"{layer}.biases"] = packed, scales, biases
        layers[layer] = spec
    return layers


def random_checkpoint(spec: str, seed: int = 0, overrides: dict[str, Any] | None = None) -> Checkpoint:
    """The :class:`Checkpoint` ``--model random:NAME[-4bit|-8bit]`` loads (``overrides``: smaller shapes, for tests)."""
    name, bits = parse_spec(spec)
    config = published_config(name, seed, overrides)
    # as published: bf16 weights (mlx-community quantizes those, and keeps its scales in bf16)
    tensors = {k: v.astype(mx.bfloat16) for k, v in random_tensors(config, seed).items()}
    quantized = quantize_tensors(tensors, bits) if bits else {}
    if bits:
        config["quantization"] = {"group_size": QUANT_GROUP_SIZE, "bits": bits}
    return Checkpoint(config=config, tensors=tensors, quantized=quantized,
                      tokenizer=lambda: byte_tokenizer(config["vocab_size"]), source=Path(spec),
                      format="random-mlx-quantized" if bits else "random")
