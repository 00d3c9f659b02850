"""Reference outputs from z-lab's own MLX DFlash 2 drafter (PyPI ``dflash==0.1.0``, ``dflash/model_mlx.py``).

``dflash.model_mlx`` imports ``mlx_lm`` and ``huggingface_hub`` at module level, so this runs only
in a side environment that has them (tests/test_dflash2_parity.py gives the commands). It imports
nothing from this repository's runtime.

Functions
---------
write_random_checkpoint(dir, ...) -> builds z-lab's ``DFlashConfig`` + ``DFlash2DraftModel`` with
                                     random weights and writes the folder a published DFlash 2
                                     drafter is: config.json (architectures ["DFlash2DraftModel"],
                                     dflash_config with the convolution and selector sizes) and
                                     model.safetensors (unprefixed names; the two codebooks without
                                     ``.weight``, which z-lab's ``load_draft`` maps back); returns dir
load_reference(dir)               -> the folder loaded by z-lab's own ``load_draft`` (float32)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def _random_parameters(model: Any, seed: int, weight_std: float) -> None:
    """Every parameter random, norms around 1; the convolutions' base kernels and the codebooks
    large enough that they change which tokens are drafted."""
    key = mx.random.key(seed)
    params = []
    for name, value in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        noise = mx.random.normal(value.shape, key=sub)
        if name.endswith("norm.weight"):
            params.append((name, 1.0 + 0.1 * noise))
        elif name.endswith("base_kernel"):
            params.append((name, 0.3 * noise))
        elif name.startswith("candidate_selector."):
            params.append((name, 0.5 * noise))
        else:
            params.append((name, weight_std * noise))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())


def write_random_checkpoint(
    dir: str,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    vocab: int = 512,
    target_layer_ids: tuple[int, ...] = (1, 4),
    num_target_layers: int = 6,
    block_size: int = 8,
    mask_token_id: int = 500,
    conv_kernel_size: int = 3,
    conv_group_size: int = 16,
    selector_rank: int = 8,
    selector_top_k: int = 6,
    seed: int = 0,
    *,
    rms_norm_eps: float = 1e-6,
    rope_theta: float = 1_000_000.0,
    max_position_embeddings: int = 4096,
    weight_std: float = 0.05,
) -> str:
    from dflash.model_mlx import DFlash2DraftModel, DFlashConfig

    sizes = dict(conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                 selector_rank=selector_rank, selector_top_k=selector_top_k)
    config = DFlashConfig(
        hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate, vocab_size=vocab,
        rms_norm_eps=rms_norm_eps, rope_theta=rope_theta, max_position_embeddings=max_position_embeddings,
        block_size=block_size, target_layer_ids=tuple(target_layer_ids), num_target_layers=num_target_layers,
        mask_token_id=mask_token_id, **sizes,
    )
    model = DFlash2DraftModel(config)
    _random_parameters(model, seed, weight_std)
    weights = dict(tree_flatten(model.parameters()))
    for name in CODEBOOKS:
        weights[name] = weights.pop(f"{name}.weight")
    folder = Path(dir)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3",
        "hidden_size": hidden_size, "intermediate_size": intermediate, "num_hidden_layers": num_layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta, "max_position_embeddings": max_position_embeddings,
        "vocab_size": vocab, "tie_word_embeddings": False, "block_size": block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": list(target_layer_ids), "mask_token_id": mask_token_id,
                          "block_size": block_size, **sizes},
    }, indent=2) + "\n")
    return str(folder)


def load_reference(dir: str) -> Any:
    """z-lab's ``load_draft`` on a local folder: its ``snapshot_download`` (the Hub) is bypassed for
    the call, the rest (config reading, codebook renaming, strict ``load_weights``) is its own."""
    from dflash import model_mlx

    hub = model_mlx.snapshot_download
    model_mlx.snapshot_download = lambda repo_id, **_: str(repo_id)
    try:
        return model_mlx.load_draft(str(dir))
    finally:
        model_mlx.snapshot_download = hub
