"""A new drafter for a target: its z-lab config, initial weights, mask token, and export.

The config written here is the one ``runtime.models.dflash.drafter_args`` parses, so
the trained drafter is built from exactly what ``load_drafter`` (and z-lab's official
loader) will read back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from ..loading import DTYPES
from ..models import DecoderArgs
from ..models.dflash import ARCHITECTURE, DFlashDrafter, default_target_layer_ids, drafter_args
from ..tokenizer import Tokenizer
from .corpora import DataError

INIT_STD = 0.02  # Qwen3's initializer_range, the official DraftModel's _init_weights
# Special tokens that chats never contain, tried in order when the embedding has no
# spare row; SmolLM2 has none, and its <empty_output> (16, a Jupyter-notebook marker)
# becomes the mask. The row is reused as it is: the embedding is never resized.
MASK_TOKEN_CANDIDATES = ("<empty_output>", "<|fim_pad|>", "<unused0>", "<|reserved_special_token_0|>")


@dataclass(frozen=True)
class DrafterShape:
    layers: int = 3
    block_size: int = 16
    intermediate_size: int | None = None  # default: the target's
    taps: tuple[int, ...] | None = None  # default: z-lab's spread of one tap per drafter layer


def choose_mask_token(target: DecoderArgs, tokenizer: Tokenizer) -> int:
    """A padded embedding row past the tokenizer if there is one, else an unused special token."""
    if target.vocab_size > tokenizer.vocab_size:
        return tokenizer.vocab_size  # like Qwen3's 151669: no text ever encodes to it
    reserved = tokenizer.eos_token_ids | {tokenizer.bos_token_id}
    for name in MASK_TOKEN_CANDIDATES:
        ids = tokenizer.encode(name, add_special_tokens=False)
        if len(ids) == 1 and ids[0] not in reserved:
            return ids[0]
    raise DataError(
        "the target's vocabulary has no spare embedding row and none of the special tokens "
        f"{MASK_TOKEN_CANDIDATES}: pass --mask-token-id with a rarely used special token's id"
    )


def drafter_config(target: DecoderArgs, shape: DrafterShape, mask_token_id: int) -> dict[str, Any]:
    """z-lab's config.json for a drafter of ``shape`` on ``target`` (hidden size = the target's)."""
    taps = list(shape.taps) if shape.taps else default_target_layer_ids(target.num_hidden_layers, shape.layers)
    check_taps(taps, target.num_hidden_layers, "(z-lab's default repeats layers on very shallow targets): pass --taps")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "intermediate_size": shape.intermediate_size or target.intermediate_size,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "vocab_size": target.vocab_size,
        "max_position_embeddings": target.max_position_embeddings,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "block_size": shape.block_size,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"target_layer_ids": taps, "mask_token_id": mask_token_id, "block_size": shape.block_size},
    }


def check_taps(taps: Sequence[int], target_layers: int, hint: str) -> None:
    """Refuse tapped layers that repeat or that the target does not have (``hint`` says what to do)."""
    if len(set(taps)) != len(taps) or not all(0 <= t < target_layers for t in taps):
        raise DataError(f"tap layers {list(taps)} must be distinct layers of the target's 0..{target_layers - 1} {hint}")


def new_drafter(config: dict[str, Any], seed: int, dtype: mx.Dtype = mx.float32) -> DFlashDrafter:
    """A drafter with seeded N(0, 0.02) linear weights and unit norms."""
    drafter = DFlashDrafter(drafter_args(config))
    keys = iter(mx.random.split(mx.random.key(seed), len(tree_flatten(drafter.parameters()))))

    def init(path: str, value: mx.array) -> mx.array:
        key = next(keys)  # drawn for every tensor so each keeps its key whatever the others are
        return mx.random.normal(value.shape, key=key) * INIT_STD if value.ndim == 2 else mx.ones(value.shape)

    drafter.update(tree_map_with_path(init, drafter.parameters()))
    drafter.set_dtype(dtype)
    mx.eval(drafter.parameters())
    return drafter


def grown_config(config: dict[str, Any], layers: int | None = None, taps: Sequence[int] | None = None) -> dict[str, Any]:
    """``config`` with ``layers`` layers (the added ones of its last layer's kind) and/or with
    ``taps`` as its tapped target layers, which must keep every layer it taps now."""
    grown = dict(config)
    if layers is not None:
        have = int(config["num_hidden_layers"])
        if layers <= have:
            raise DataError(f"--grow-to {layers}: the drafter already has {have} layers; grow to more")
        grown["num_hidden_layers"] = layers
        if config.get("layer_types"):
            grown["layer_types"] = list(config["layer_types"]) + [config["layer_types"][-1]] * (layers - have)
    if taps is not None:
        args = drafter_args(config)
        if not set(args.target_layer_ids) < set(taps):
            raise DataError(f"--taps {list(taps)} with --init: list the drafter's taps {args.target_layer_ids} and at "
                            "least one more layer")
        check_taps(taps, args.num_target_layers, "(--taps with --init)")
        grown["dflash_config"] = dict(config.get("dflash_config") or {}, target_layer_ids=list(taps))
    return grown


def grown_drafter(start: DFlashDrafter, config: dict[str, Any], seed: int, dtype: mx.Dtype) -> DFlashDrafter:
    """A drafter with more layers or taps than ``start`` that starts out drafting exactly as it:
    its first layers are ``start``'s, each added layer's output projections are zero (it adds
    nothing to the residual stream until training moves them; their inputs' projections start
    random), and ``fc`` reads an added tap through zero columns (see ``widened_fc``)."""
    grown = new_drafter(config, seed, dtype)
    grown.update(start.parameters())  # every tensor start has, by name; the added layers keep theirs
    grown.fc.weight = widened_fc(start.fc.weight, start.args.target_layer_ids, grown.args.target_layer_ids)
    for layer in grown.layers[len(start.layers):]:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    mx.eval(grown.parameters())
    return grown


def widened_fc(weight: mx.array, taps: Sequence[int], wider: Sequence[int]) -> mx.array:
    """``fc``'s weight ``[H, len(wider)*H]`` for the taps ``wider``: a tap of ``taps`` keeps its
    columns (the input is ``[token, tap*H]`` in tap order), an added one gets zeros."""
    width = weight.shape[1] // len(taps)
    columns = {tap: weight[:, i * width:(i + 1) * width] for i, tap in enumerate(taps)}
    zeros = mx.zeros((weight.shape[0], width), weight.dtype)
    return mx.concatenate([columns.get(tap, zeros) for tap in wider], axis=1)


def cast_parameters(model: nn.Module, dtype: mx.Dtype) -> dict[str, Any]:
    return tree_map(lambda p: p.astype(dtype), model.parameters())


def save_drafter(folder: Path, drafter: DFlashDrafter, config: dict[str, Any], dtype: str = "bfloat16") -> Path:
    """Write config.json + model.safetensors (unprefixed names) that z-lab loaders read."""
    return write_z_lab_folder(folder, dict(tree_flatten(cast_parameters(drafter, DTYPES[dtype]))), config, dtype)


def write_z_lab_folder(folder: Path, weights: dict[str, mx.array], config: dict[str, Any], dtype: str) -> Path:
    """``weights`` (already in ``dtype``) and ``config`` as the folder z-lab's loaders read."""
    folder.mkdir(parents=True, exist_ok=True)
    # transformers refuses safetensors files whose metadata lacks a known format
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(dict(config, torch_dtype=dtype), indent=2) + "\n")
    return folder


def parameter_count(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))
