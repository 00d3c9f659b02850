"""Write the default target as a plain HF folder, for servers that read only those (mlx_lm.server).

    python deploy/export_hf.py OUT_DIR [--dtype bfloat16]

config.json (the HF config the loader derived), model.safetensors (dequantized weights
under mlx-lm's names, which our modules share), tokenizer.json and tokenizer_config.json
(with the chat template), so a comparison runs the same weights and the same prompts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from runtime.defaults import default_model_path
from runtime.loading import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    target = load_target(args.model or default_model_path(), dtype=args.dtype, fuse=False)  # HF names
    args.out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(target.model.parameters()))
    mx.save_safetensors(str(args.out / "model.safetensors"), weights, metadata={"format": "mlx"})
    tok = target.tokenizer
    config = {**target.config, "torch_dtype": args.dtype, "bos_token_id": tok.bos_token_id,
              "eos_token_id": sorted(tok.eos_token_ids)}
    (args.out / "config.json").write_text(json.dumps(config, indent=2))
    tok._backend.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
        "bos_token": tok.bos_token, "eos_token": tok.eos_token, "model_max_length": config["max_position_embeddings"],
    }, indent=2))
    print(f"wrote {args.out} ({len(weights)} tensors, {args.dtype})")


if __name__ == "__main__":
    main()
