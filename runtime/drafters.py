"""Choosing a drafter: a checkpoint folder, the bundled default, or random weights.

``random:L`` builds an untrained L-layer drafter shaped for the target: acceptance is ~1,
which isolates the runtime's overhead (pipelining, host work) from the drafter's quality.
"""

from __future__ import annotations

import mlx.core as mx

from .defaults import default_drafter_path
from .errors import CheckpointError
from .loading import DTYPES, LoadedModel, load_drafter
from .models.dflash import DFlashDrafter, DrafterArgs, default_target_layer_ids

RANDOM_PREFIX = "random:"


def random_drafter(target: LoadedModel, layers: int = 5, block_size: int = 16, seed: int = 0) -> DFlashDrafter:
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
    )
    mx.random.seed(seed)
    drafter = DFlashDrafter(args)
    drafter.set_dtype(DTYPES.get(target.compute_dtype, mx.float32))
    mx.eval(drafter.parameters())
    drafter.fuse_projections()
    return drafter.bind(target.model)


def resolve_drafter(spec: str | None, target: LoadedModel, block_size: int = 16) -> DFlashDrafter:
    """``None``: the bundled drafter; ``random:L``: random weights; else a checkpoint folder."""
    if spec is None:
        path = default_drafter_path()
        if path is None:
            raise CheckpointError("this checkout bundles no drafter yet: pass --draft PATH (or random:5)")
        return load_drafter(path, target)
    if spec.startswith(RANDOM_PREFIX):
        layers = spec[len(RANDOM_PREFIX):] or "5"
        if not layers.isdigit() or int(layers) < 1:
            raise CheckpointError(f"--draft {spec}: random:L needs a layer count L of at least 1 (e.g. random:5)")
        return random_drafter(target, layers=int(layers), block_size=block_size)
    return load_drafter(spec, target)
