"""Choosing a drafter: a checkpoint folder, the bundled default, or random weights.

``random:L`` builds an untrained L-layer drafter shaped for the target: acceptance is ~1,
which isolates the runtime's overhead (pipelining, host work) from the drafter's quality.
``random:L:dflash2`` builds a DFlash 2 one (each layer's convolutions and the candidate
selector, sized by ``RANDOM_DFLASH2``), to measure what they add.
"""

from __future__ import annotations

import math
from typing import TypeVar

import mlx.core as mx

from .defaults import default_drafter_path
from .errors import CheckpointError
from .loading import DTYPES, LoadedModel, load_drafter
from .models.dflash import DFlashDrafter, DrafterArgs, default_target_layer_ids

RANDOM_PREFIX = "random:"
D = TypeVar("D", bound=DFlashDrafter)
DFLASH2_SUFFIX = "dflash2"
# a random DFlash 2 drafter's sizes (the group size shrinks to divide a target's hidden size)
RANDOM_DFLASH2 = {"conv_kernel_size": 4, "conv_group_size": 16, "selector_rank": 64, "selector_top_k": 8}


def random_dflash2_sizes(hidden_size: int, vocab_size: int) -> dict[str, int]:
    sizes = dict(RANDOM_DFLASH2, vocab_size=vocab_size)
    sizes["conv_group_size"] = math.gcd(hidden_size, sizes["conv_group_size"])
    sizes["selector_top_k"] = min(sizes["selector_top_k"], vocab_size)
    return sizes


def random_drafter(target: LoadedModel, layers: int = 5, dflash2: bool = False, block_size: int = 16, seed: int = 0,
                   drafter_class: type[D] = DFlashDrafter) -> D:  # type: ignore[assignment]
    t = target.model.args
    n_taps = min(layers, 5)
    args = DrafterArgs(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_hidden_layers=layers,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
        head_dim=t.head_dim or t.hidden_size // t.num_attention_heads, rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta, rope_scaling=None, block_size=block_size,
        # distinct layers: a shallow target has fewer spread-out layers than taps asked for
        target_layer_ids=sorted(set(default_target_layer_ids(t.num_hidden_layers, n_taps))),
        num_target_layers=t.num_hidden_layers, mask_token_id=0,
        causal_layers=[False] * layers, sliding_layers=[False] * layers, sliding_window=None,
        **(random_dflash2_sizes(t.hidden_size, t.vocab_size) if dflash2 else {}),
    )
    mx.random.seed(seed)
    drafter = drafter_class(args)
    drafter.set_dtype(DTYPES.get(target.compute_dtype, mx.float32))
    mx.eval(drafter.parameters())
    drafter.fuse_projections()
    drafter.bind(target.model)
    return drafter


def resolve_drafter(spec: str | None, target: LoadedModel, block_size: int = 16) -> DFlashDrafter:
    """``None``: the bundled drafter; ``random:L`` (``random:L:dflash2``): random weights; else a checkpoint folder."""
    if spec is None:
        path = default_drafter_path()
        if path is None:
            raise CheckpointError("this checkout bundles no drafter yet: pass --draft PATH (or random:5)")
        return load_drafter(path, target)
    if spec.startswith(RANDOM_PREFIX):
        return random_drafter(target, *parse_random_spec(spec), block_size=block_size)
    return load_drafter(spec, target)


def parse_random_spec(spec: str) -> tuple[int, bool]:
    """``random:L[:dflash2]`` -> (L, whether DFlash 2)."""
    layers, _, kind = spec[len(RANDOM_PREFIX):].partition(":")
    layers = layers or "5"
    if not spec.startswith(RANDOM_PREFIX) or not layers.isdigit() or int(layers) < 1 or kind not in ("", DFLASH2_SUFFIX):
        raise CheckpointError(f"--draft {spec}: random:L needs a layer count L of at least 1 (e.g. random:5), "
                              f"random:L:{DFLASH2_SUFFIX} a DFlash 2 drafter (e.g. random:5:{DFLASH2_SUFFIX})")
    return int(layers), kind == DFLASH2_SUFFIX
