"""``python -m runtime.convert``: write a target as a plain HF/MLX folder, for tools that read only those (mlx_lm).

    python -m runtime.convert --out DIR [--model PATH.gguf|FOLDER|random:qwen3-8b-4bit] [--dtype bfloat16|native|...]

As ``mlx_lm.convert`` writes a folder mlx-lm loads, this writes one from any model this
runtime loads (a GGUF file, a random target of a published shape):

config.json (the HF config the loader derived), model.safetensors (weights under mlx-lm's
names, which our modules share), tokenizer.json and tokenizer_config.json (with the chat
template), so a comparison runs the same weights and the same prompts. ``--dtype native``
keeps quantized layers packed (config.json then gets mlx-lm's ``quantization`` entry); a
float dtype writes them unpacked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .cli import add_model_arguments, new_parser, run_cli
from .defaults import default_model_path
from .loading import LoadedModel, load_target


def quantization_entry(model: nn.Module) -> dict[str, Any] | None:
    """mlx-lm's config ``quantization``: the common group size and bits, and any layer that differs."""
    layers = {path: {"group_size": m.group_size, "bits": m.bits} for path, m in model.named_modules()
              if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    if not layers:
        return None
    specs = list(layers.values())
    common = max(specs, key=specs.count)
    return {**common, **{path: spec for path, spec in layers.items() if spec != common}}


def export(target: LoadedModel, out: Path) -> int:
    """Write ``target`` (loaded with fuse=False: HF names) to ``out``; returns the tensor count."""
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(target.model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tok = target.tokenizer
    config = {k: v for k, v in target.config.items() if k not in ("quantization", "quantization_config")}
    config.update(torch_dtype=target.compute_dtype, bos_token_id=tok.bos_token_id, eos_token_id=sorted(tok.eos_token_ids))
    quantization = quantization_entry(target.model)
    if quantization:
        config["quantization"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok._backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "model_max_length": config["max_position_embeddings"],
    }, indent=2))
    return len(weights)


def main(argv: list[str] | None = None) -> None:
    parser = new_parser("python -m runtime.convert", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.set_defaults(dtype="bfloat16")
    args = parser.parse_args(argv)
    target = load_target(args.model or default_model_path(), dtype=args.dtype, fuse=False)  # HF names
    count = export(target, args.out)
    print(f"wrote {args.out} ({count} tensors, {target.compute_dtype}{', quantized' if target.quantized else ''})")


if __name__ == "__main__":
    run_cli(main)
