"""``python -m runtime.training.average A B --out C [--weight 0.5]``: two drafters' weights averaged.

Two drafters trained from one starting point on different data each draft some sets
better (issue #5: one more stage on chat raised chat's tau and lowered HumanEval's a
little); the average of their weights (a "model soup") can keep much of both (there: the
earlier drafter's HumanEval tau and half of the chat stage's gain).
The drafters must have the same layers; if one taps more target layers than the other
(``train --taps``), the other's ``fc`` is first widened with zero columns for the added
taps, which drafts exactly as it did (runtime.training.drafter.widened_fc). Packed
drafters (runtime.training.pack) are unpacked first; the result is a bf16 z-lab folder
(pack it again to bundle it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..cli import new_parser, run_cli
from ..errors import CheckpointError
from ..loading import dequantize_layers, quantized_layers, read_safetensors, safetensors_files
from .drafter import widened_fc, write_z_lab_folder


def read_drafter(folder: Path) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """A drafter folder's config and float32 weights (unpacked if packed)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    tensors = read_safetensors(safetensors_files(folder), f"reading {folder.name}")
    dequantize_layers(tensors, quantized_layers(tensors, config), mx.float32, folder)
    config.pop("quantization", None)
    return config, {name: t.astype(mx.float32) for name, t in tensors.items()}


def taps_of(config: dict[str, Any]) -> list[int]:
    return list(config["dflash_config"]["target_layer_ids"])


def average_drafters(a: Path, b: Path, weight: float = 0.5) -> tuple[dict[str, Any], dict[str, mx.array]]:
    """``weight * A + (1 - weight) * B``, with the config of whichever taps more layers."""
    (config_a, tensors_a), (config_b, tensors_b) = read_drafter(a), read_drafter(b)
    taps_a, taps_b = taps_of(config_a), taps_of(config_b)
    if set(taps_b) <= set(taps_a):
        config, wider = config_a, taps_a
    elif set(taps_a) <= set(taps_b):
        config, wider = config_b, taps_b
    else:
        raise CheckpointError(f"{a.name} taps {taps_a} and {b.name} taps {taps_b}: neither holds the other's taps")
    if set(tensors_a) != set(tensors_b):
        raise CheckpointError(f"{a.name} and {b.name} differ in tensors: {sorted(set(tensors_a) ^ set(tensors_b))}")
    for tensors, taps in ((tensors_a, taps_a), (tensors_b, taps_b)):
        tensors["fc.weight"] = widened_fc(tensors["fc.weight"], taps, wider)
    averaged = {}
    for name, ta in tensors_a.items():
        tb = tensors_b[name]
        if ta.shape != tb.shape:
            raise CheckpointError(f"{name}: {a.name} has {ta.shape}, {b.name} has {tb.shape}")
        averaged[name] = (weight * ta + (1 - weight) * tb).astype(mx.bfloat16)
    return config, averaged


def main(argv: list[str] | None = None) -> None:
    parser = new_parser("python -m runtime.training.average", __doc__)
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--weight", type=float, default=0.5, help="A's share (B gets the rest)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.weight <= 1.0:
        parser.error("--weight must lie in [0, 1]")

    def run() -> None:
        config, weights = average_drafters(args.a, args.b, args.weight)
        write_z_lab_folder(args.out, weights, config, "bfloat16")
        print(f"{args.out}: {args.weight:g} x {args.a} + {1 - args.weight:g} x {args.b}, taps {taps_of(config)}")

    run_cli(run)


if __name__ == "__main__":
    main()
