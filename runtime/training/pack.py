"""``python -m runtime.training.pack SRC OUT [--bits 8] [--group-size 64] [--unpack]``: a drafter in fewer bits.

The bundled drafter must stay within 25 MB, and in bf16 that holds three layers of
SmolLM2's width. Packed in 8 bits (MLX's affine quantization: each projection's weight
packed, with a scale and a bias per group of ``group_size`` columns, in bf16), a layer
takes about half, so five or six fit. The runtime unpacks a packed drafter into its compute
dtype at load (``load_drafter``): drafting is unchanged but for the rounding. z-lab's
loader reads the unpacked form only, which is what ``runtime.train`` writes and what
``--unpack`` makes of a packed drafter (the bundled one, say) in bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from ..cli import new_parser, run_cli
from ..errors import CheckpointError
from ..loading import dequantize_layers, quantized_layers, read_safetensors, safetensors_files
from .drafter import write_z_lab_folder


def packable(name: str, tensor: mx.array, group_size: int) -> bool:
    """Projection weights (2D, whole groups per row); norms stay as they are."""
    return name.endswith(".weight") and tensor.ndim == 2 and tensor.shape[-1] % group_size == 0


def pack_drafter(src: Path, out: Path, bits: int = 8, group_size: int = 64) -> tuple[int, int]:
    """Write ``out`` (config.json + model.safetensors) packed; returns the weights' bytes before and after."""
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if config.get("quantization"):
        raise CheckpointError(f"{src} is already packed ({config['quantization']})")
    tensors = read_safetensors(safetensors_files(src), f"reading {src.name}")
    packed: dict[str, mx.array] = {}
    for name, tensor in tensors.items():
        if not packable(name, tensor, group_size):
            packed[name] = tensor
            continue
        weight, scales, biases = mx.quantize(tensor.astype(mx.float32), group_size=group_size, bits=bits)
        layer = name[: -len(".weight")]
        packed.update({name: weight, f"{layer}.scales": scales.astype(mx.bfloat16),
                       f"{layer}.biases": biases.astype(mx.bfloat16)})
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), packed, metadata={"format": "mlx"})
    config = dict(config, quantization={"group_size": group_size, "bits": bits})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return sum(t.nbytes for t in tensors.values()), sum(t.nbytes for t in packed.values())


def unpack_drafter(src: Path, out: Path) -> tuple[int, int]:
    """Write ``out`` as a z-lab folder in bf16 from the packed ``src``; returns the weights' bytes before and after."""
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if not config.get("quantization"):
        raise CheckpointError(f"{src} is not packed (its config.json has no quantization)")
    tensors = read_safetensors(safetensors_files(src), f"reading {src.name}")
    before = sum(t.nbytes for t in tensors.values())
    dequantize_layers(tensors, quantized_layers(tensors, config), mx.float32, src)
    unpacked = {name: t.astype(mx.bfloat16) for name, t in tensors.items()}
    write_z_lab_folder(out, unpacked, {k: v for k, v in config.items() if k != "quantization"}, "bfloat16")
    return before, sum(t.nbytes for t in unpacked.values())


def main(argv: list[str] | None = None) -> None:
    parser = new_parser("python -m runtime.training.pack", __doc__)
    parser.add_argument("src", type=Path, help="a drafter folder (runtime.train's output)")
    parser.add_argument("out", type=Path)
    parser.add_argument("--bits", type=int, default=8, choices=(4, 8))
    parser.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    parser.add_argument("--unpack", action="store_true", help="the reverse: a packed SRC to a z-lab folder in bf16")
    args = parser.parse_args(argv)
    if args.unpack:
        before, after = unpack_drafter(args.src, args.out)
        print(f"{args.out}: weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB (bf16, z-lab's format)")
        return
    before, after = pack_drafter(args.src, args.out, args.bits, args.group_size)
    print(f"{args.out}: weights {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB ({args.bits} bits, groups of {args.group_size})")


if __name__ == "__main__":
    run_cli(main)
