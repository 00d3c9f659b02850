"""Reference outputs from z-lab's official PyTorch DFlash drafter (PyPI ``dflash==0.1.0``).

Runs only in a venv that has ``dflash[local]==0.1.0`` (torch 2.13.0 CPU, transformers 5.15.0),
e.g. /tmp/dflashenv. It imports nothing from this repository's runtime.

    /tmp/dflashenv/bin/python tests/reference/dflash_torch_reference.py [OUT_DIR]

Functions
---------
write_random_checkpoint(dir, ...)      -> writes config.json + model.safetensors with the official
                                          config/model class (``save_pretrained``), returns dir
reference_drafter_hidden(dir, noise_embedding, target_hidden, position_ids)
                                       -> one no-cache forward; returns the model's output, which
                                          is AFTER the drafter's final ``norm`` and BEFORE lm_head
reference_drafter_rounds(dir, rounds)  -> several forwards sharing one drafter cache, exactly as
                                          ``dflash.model.dflash_generate`` drives it
reference_logits(hidden, lm_head_weight, config) -> ``DFlashDraftModel.compute_logits`` equivalent

See DFLASH_REFERENCE_NOTES.md beside this file.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _torch():
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return torch


def _load(checkpoint_dir: str):
    """Load a z-lab format drafter folder with the official class, float32, CPU, eval."""
    torch = _torch()
    from transformers import AutoConfig

    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    # Same class choice as dflash.benchmark.load_transformers_models.
    config = AutoConfig.from_pretrained(checkpoint_dir)
    cls = (
        DFlash2DraftModel
        if "DFlash2DraftModel" in (config.architectures or [])
        else DFlashDraftModel
    )
    model = cls.from_pretrained(checkpoint_dir, dtype=torch.float32)
    return model.to("cpu").eval()


def _as_batch(x: np.ndarray, ndim: int, dtype):
    """Accept an unbatched array and add the batch dim of 1."""
    torch = _torch()
    x = np.asarray(x)
    if x.ndim == ndim - 1:
        x = x[None]
    if x.ndim != ndim:
        raise ValueError(f"expected {ndim - 1} or {ndim} dims, got shape {x.shape}")
    return torch.from_numpy(np.ascontiguousarray(x)).to(dtype)


def reference_drafter_hidden(
    checkpoint_dir: str,
    noise_embedding: np.ndarray,
    target_hidden: np.ndarray,
    position_ids: np.ndarray | None = None,
    *,
    model=None,
) -> np.ndarray:
    """One forward of the official DFlashDraftModel with no cache.

    noise_embedding: [B, H] or [1, B, H]  target embeddings of the block
                     (anchor, MASK, ..., MASK), already multiplied by input_embedding_scale.
    target_hidden:   [C, n_taps*H] or [1, C, n_taps*H]  raw concatenated target taps
                     (fc + hidden_norm are applied INSIDE the model).
    position_ids:    [C+B] or [1, C+B]; ctx positions first, then block positions.
                     Default: 0..C+B-1 (ctx at 0..C-1, block at C..C+B-1).
    Returns float32 [1, B, H]: the model's return value = norm(last layer output),
    i.e. final RMSNorm applied, lm_head NOT applied. Includes the anchor row (index 0);
    dflash_generate keeps only rows 1..B-1.
    """
    torch = _torch()
    model = model if model is not None else _load(checkpoint_dir)
    noise = _as_batch(noise_embedding, 3, torch.float32)
    ctx = _as_batch(target_hidden, 3, torch.float32)
    C, B = ctx.shape[1], noise.shape[1]
    if position_ids is None:
        position_ids = np.arange(C + B, dtype=np.int64)
    pos = _as_batch(position_ids, 2, torch.long)
    if pos.shape[1] != C + B:
        raise ValueError(f"position_ids must have C+B={C + B} entries, got {pos.shape[1]}")
    with torch.inference_mode():
        out = model(
            position_ids=pos,
            noise_embedding=noise,
            target_hidden=ctx,
            past_key_values=None,
            use_cache=False,
        )
    return out.float().numpy()


def reference_drafter_rounds(checkpoint_dir: str, rounds, *, model=None) -> list[np.ndarray]:
    """Several drafter calls sharing one cache, driven exactly like dflash_generate.

    rounds: list of (noise_embedding [B,H], target_hidden [C_r, n*H], start) where `start` is
    the absolute position of the block's anchor; the new ctx rows sit at start-C_r..start-1.
    After each call the cache is cropped back to `start` entries (block K/V dropped).
    Returns one float32 [1, B, H] array per round (full block, anchor row included).
    """
    torch = _torch()
    from dflash.model import _crop_to, _make_cache

    model = model if model is not None else _load(checkpoint_dir)
    cache = _make_cache(model.config)
    outs = []
    with torch.inference_mode():
        for noise_embedding, target_hidden, start in rounds:
            noise = _as_batch(noise_embedding, 3, torch.float32)
            ctx = _as_batch(target_hidden, 3, torch.float32)
            C, B = ctx.shape[1], noise.shape[1]
            if cache.get_seq_length() != start - C:
                raise ValueError(
                    f"cache holds {cache.get_seq_length()} positions; new ctx must start there "
                    f"(start - C = {start - C})"
                )
            pos = torch.arange(start - C, start + B, dtype=torch.long)[None]
            out = model(
                position_ids=pos,
                noise_embedding=noise,
                target_hidden=ctx,
                past_key_values=cache,
                use_cache=True,
            )
            _crop_to(cache, start)
            outs.append(out.float().numpy())
    return outs


def reference_logits(hidden: np.ndarray, lm_head_weight: np.ndarray, config=None) -> np.ndarray:
    """compute_logits: (hidden @ W.T) * output_multiplier, then optional tanh softcap."""
    torch = _torch()
    from dflash.model import _draft_value

    h = torch.from_numpy(np.asarray(hidden, dtype=np.float32))
    w = torch.from_numpy(np.asarray(lm_head_weight, dtype=np.float32))
    logits = h @ w.T
    if config is not None:
        logits = logits * float(_draft_value(config, "output_multiplier", 1.0))
        cap = _draft_value(config, "final_logit_softcapping")
        if cap is not None and float(cap) > 0:
            logits = torch.tanh(logits / float(cap)) * float(cap)
    return logits.numpy()


def write_random_checkpoint(
    dir: str,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    intermediate: int = 128,
    vocab: int = 512,
    target_layer_ids=(1, 3),
    num_target_layers: int = 6,
    block_size: int = 8,
    mask_token_id: int = 500,
    seed: int = 0,
    *,
    rms_norm_eps: float = 1e-6,
    rope_theta: float = 1_000_000.0,
    max_position_embeddings: int = 4096,
    layer_types=None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    dtype: str = "float32",
    weight_std: float = 0.05,
    legacy_config: bool = False,
) -> str:
    """Write a random-weight z-lab-format drafter folder with the official classes.

    Uses Qwen3Config (the official config_class) + DFlashDraftModel + save_pretrained, so the
    folder is exactly what the official code writes/reads: config.json (model_type "qwen3",
    architectures ["DFlashDraftModel"], top-level block_size / num_target_layers, and
    dflash_config {target_layer_ids, mask_token_id, block_size}) and model.safetensors
    (unprefixed keys: fc.weight, hidden_norm.weight, layers.N..., norm.weight).
    All weights, norms included, are random (norm weights = 1 + N(0, 0.1)).

    transformers 5.x writes RoPE as ``rope_parameters: {rope_type, rope_theta}``. With
    ``legacy_config=True`` config.json is rewritten the way published DFlash(-b16) drafters
    (saved by transformers 4.x) look: top-level ``rope_theta`` + ``rope_scaling: null`` and
    ``block_size`` only at top level (not in dflash_config). The official loader reads both.
    """
    torch = _torch()
    from transformers import Qwen3Config

    from dflash.model import DFlashDraftModel

    target_layer_ids = [int(i) for i in target_layer_ids]
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={
            "target_layer_ids": target_layer_ids,
            "mask_token_id": int(mask_token_id),
            "block_size": int(block_size),
        },
    )
    if layer_types is not None:
        kwargs["layer_types"] = list(layer_types)
    if sliding_window is not None:
        # Qwen3Config discards sliding_window unless use_sliding_window is true.
        kwargs["use_sliding_window"] = True
        kwargs["sliding_window"] = int(sliding_window)
    if is_causal is not None:
        kwargs["is_causal"] = bool(is_causal)
    config = Qwen3Config(**kwargs)

    torch.manual_seed(seed)
    model = DFlashDraftModel(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(weight_std * torch.randn(p.shape, generator=gen))
    model = model.to(getattr(torch, dtype))
    Path(dir).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dir, safe_serialization=True)
    if legacy_config:
        import json

        path = Path(dir) / "config.json"
        cfg = json.loads(path.read_text())
        rope = cfg.pop("rope_parameters")
        cfg["rope_theta"] = rope["rope_theta"]
        cfg["rope_scaling"] = None
        cfg["dflash_config"].pop("block_size", None)
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return str(dir)


def _demo(out_dir: str) -> None:
    import json

    from safetensors.numpy import load_file

    ckpt = write_random_checkpoint(out_dir, seed=0)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    weights = load_file(str(Path(ckpt) / "model.safetensors"))
    print("wrote", ckpt, sorted(os.listdir(ckpt)))
    print("config keys:", {k: cfg[k] for k in ("architectures", "model_type", "block_size",
                                                 "num_target_layers", "dflash_config")})
    print("tensors:", {k: tuple(v.shape) for k, v in sorted(weights.items())[:6]}, "...",
          len(weights), "total")

    rng = np.random.default_rng(1)
    H, n_taps = cfg["hidden_size"], len(cfg["dflash_config"]["target_layer_ids"])
    C, B = 5, cfg["block_size"]
    noise = rng.standard_normal((B, H)).astype(np.float32)
    ctx = rng.standard_normal((C, n_taps * H)).astype(np.float32)
    model = _load(ckpt)
    out = reference_drafter_hidden(ckpt, noise, ctx, np.arange(C + B), model=model)
    print("one forward: out", out.shape, out.dtype, "first row[:4]", out[0, 0, :4])

    # Cache equivalence: ctx split over two rounds == one-shot forward with all ctx.
    C2 = 3
    ctx2 = rng.standard_normal((C2, n_taps * H)).astype(np.float32)
    r = reference_drafter_rounds(ckpt, [(noise, ctx, C), (noise, ctx2, C + C2)], model=model)
    full = reference_drafter_hidden(ckpt, noise, np.concatenate([ctx, ctx2]),
                                    np.arange(C + C2 + B), model=model)
    print("round0 == one forward:", float(np.abs(r[0] - out).max()))
    print("round1 (cached) == one forward over all ctx:", float(np.abs(r[1] - full).max()))

    legacy = write_random_checkpoint(str(Path(out_dir) / "legacy"), seed=0, legacy_config=True)
    out_legacy = reference_drafter_hidden(legacy, noise, ctx, np.arange(C + B))
    print("legacy-format config (rope_theta top level) == same output:",
          float(np.abs(out_legacy - out).max()))


if __name__ == "__main__":
    import sys
    import tempfile

    _demo(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="dflash_ref_"))
