"""Read checkpoints into MLX models: Hugging Face folders, MLX-quantized folders, GGUF files.

Every format is first read into a :class:`Checkpoint` (an HF-style config, tensors under
HF names, quantized layers as ``weight/scales/biases`` triples, a tokenizer source), then
one builder checks each tensor against the model it builds and loads it. So every
format gets the same checks: a missing, extra or misshaped tensor is named.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tqdm import tqdm

from .errors import CheckpointError, UnsupportedArchitectureError
from .models import DecoderModel, build_model, decoder_args
from .models.dflash import DFlashDrafter, drafter_args
from .tokenizer import Tokenizer

PROGRESS_MIN_BYTES = 64 << 20  # smaller files load too fast for a progress bar to help
RANDOM_TARGET_PREFIX = "random:"  # runtime.random_targets: a published shape with random weights
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class QuantSpec:
    group_size: int
    bits: int


@dataclass
class Checkpoint:
    """A checkpoint read from disk, before any model is built."""

    config: dict[str, Any]
    tensors: dict[str, mx.array]
    quantized: dict[str, QuantSpec]  # layer path -> how its weight is packed
    tokenizer: Callable[[], Tokenizer]
    source: Path
    format: str
    files: list[Path] = field(default_factory=list)


@dataclass
class LoadedModel:
    model: DecoderModel
    tokenizer: Tokenizer
    config: dict[str, Any]
    source: Path
    format: str
    compute_dtype: str
    quantized: bool
    files: list[Path]

    @property
    def name(self) -> str:
        return self.source.stem if self.source.is_file() else self.source.name

    def content_hash(self) -> str:
        """sha256 over the checkpoint's files, so a log can name exactly which weights ran."""
        return hash_files(self.files)


def hash_files(files: Iterable[Path]) -> str:
    digest = hashlib.sha256()
    for path in sorted(files):
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def hash_folder(folder: Path) -> str:
    """sha256 over a checkpoint folder's files (how logs name a drafter's exact weights)."""
    return hash_files(p for p in folder.iterdir() if p.is_file())


def _progress(total_bytes: int, desc: str) -> tqdm:
    """A byte-counting bar on stderr, shown only on a terminal and for large checkpoints."""
    return tqdm(
        total=total_bytes, desc=desc, unit="B", unit_scale=True, file=sys.stderr,
        disable=None if total_bytes >= PROGRESS_MIN_BYTES else True, leave=False,
    )


# ---------------------------------------------------------------- Hugging Face folders


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: a model folder needs its config.json") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); re-download it") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise CheckpointError(
                f"{folder}: the index names shards that are not there: {missing}; "
                "download every shard the index lists"
            )
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(
        f"{folder} holds no model.safetensors (nor an index of shards); "
        "point --model at a folder with the weights, or at a .gguf file"
    )


def read_safetensors(files: list[Path], desc: str) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    with _progress(sum(f.stat().st_size for f in files), desc) as bar:
        for path in files:
            try:
                tensors.update(mx.load(str(path)))
            except (RuntimeError, ValueError) as exc:  # a truncated or corrupt file: MLX names the tensor
                raise CheckpointError(f"{path} cannot be read ({exc}); download or write it again") from None
            bar.update(path.stat().st_size)
    return tensors


def quantized_layers(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, QuantSpec]:
    """Layers stored as MLX affine triples, with their group size and bits from the config."""
    qconfig = config.get("quantization") or config.get("quantization_config") or {}
    layers: dict[str, QuantSpec] = {}
    for name in tensors:
        if not name.endswith(".scales"):
            continue
        path = name[: -len(".scales")]
        own = qconfig.get(path) if isinstance(qconfig.get(path), dict) else qconfig
        if "group_size" not in own or "bits" not in own:
            raise CheckpointError(
                f"{path} is quantized but config.json has no quantization "
                "{group_size, bits}: use the config.json that came with these weights"
            )
        layers[path] = QuantSpec(int(own["group_size"]), int(own["bits"]))
    return layers


def read_hf_folder(folder: Path) -> Checkpoint:
    config = _read_json(folder / "config.json")
    files = safetensors_files(folder)
    tensors = read_safetensors(files, f"loading {folder.name}")
    quantized = quantized_layers(tensors, config)
    return Checkpoint(
        config=config, tensors=tensors, quantized=quantized,
        tokenizer=lambda: Tokenizer.from_folder(folder), source=folder,
        format="mlx-quantized" if quantized else "huggingface",
        files=files + [folder / "config.json"],
    )


# ---------------------------------------------------------------- GGUF


GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
GGUF_NAMES = [
    (r"^token_embd\.", "model.embed_tokens."),
    (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."),
    (r"^blk\.(\d+)\.attn_q\.", r"model.layers.\1.self_attn.q_proj."),
    (r"^blk\.(\d+)\.attn_k\.", r"model.layers.\1.self_attn.k_proj."),
    (r"^blk\.(\d+)\.attn_v\.", r"model.layers.\1.self_attn.v_proj."),
    (r"^blk\.(\d+)\.attn_output\.", r"model.layers.\1.self_attn.o_proj."),
    (r"^blk\.(\d+)\.attn_q_norm\.", r"model.layers.\1.self_attn.q_norm."),
    (r"^blk\.(\d+)\.attn_k_norm\.", r"model.layers.\1.self_attn.k_norm."),
    (r"^blk\.(\d+)\.attn_norm\.", r"model.layers.\1.input_layernorm."),
    (r"^blk\.(\d+)\.ffn_norm\.", r"model.layers.\1.post_attention_layernorm."),
    (r"^blk\.(\d+)\.ffn_gate\.", r"model.layers.\1.mlp.gate_proj."),
    (r"^blk\.(\d+)\.ffn_up\.", r"model.layers.\1.mlp.up_proj."),
    (r"^blk\.(\d+)\.ffn_down\.", r"model.layers.\1.mlp.down_proj."),
]
GGUF_GROUP_SIZE = 32  # MLX unpacks Q4_0/Q4_1/Q8_0 blocks of 32 into affine groups of 32


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, mx.array) else value


def gguf_config(metadata: dict[str, Any]) -> dict[str, Any]:
    arch = _scalar(metadata.get("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(GGUF_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = _scalar(metadata.get(f"{arch}.{key}", default))
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}; the file is incomplete")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": len(metadata.get("tokenizer.ggml.tokens", [])) or int(get("vocab_size")),
    }


def _gguf_name(name: str) -> str:
    for pattern, replacement in GGUF_NAMES:
        renamed, n = re.subn(pattern, replacement, name)
        if n:
            return renamed
    return name  # left as is: the builder reports it as an unexpected tensor


def undo_llama_cpp_permutation(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp interleaves each head's Q/K rows for its RoPE; put them back in HF order."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_READABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def gguf_tensor_count(path: Path) -> int:
    """The header's tensor count (magic, version, then a little-endian uint64)."""
    with open(path, "rb") as handle:
        header = handle.read(16)
    if header[:4] != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (bad magic); re-download it")
    return int.from_bytes(header[8:16], "little")


def unreadable_gguf_tensors(path: Path) -> list[str]:
    """``name (TYPE)`` for each tensor whose type MLX cannot read (slow: error path only)."""
    from gguf import GGUFReader

    return [f"{t.name} ({t.tensor_type.name})" for t in GGUFReader(str(path)).tensors
            if t.tensor_type.name not in GGUF_READABLE]


def _refuse_gguf(path: Path, detail: str) -> CheckpointError:
    bad = unreadable_gguf_tensors(path)
    return CheckpointError(
        f"{path}: unsupported GGUF tensor type(s): {', '.join(bad[:4]) or detail}. "
        f"MLX reads {', '.join(GGUF_READABLE)} (Q4_0, Q4_1 and Q8_0 stay packed): "
        "re-quantize the model to one of them"
    )


def read_gguf(path: Path) -> Checkpoint:
    try:
        raw, metadata = mx.load(str(path), return_metadata=True)  # lazy: read when built
    except (RuntimeError, ValueError) as exc:
        raise _refuse_gguf(path, str(exc)) from None
    read = [k for k in raw if not k.endswith((".scales", ".biases"))]  # packed: 3 arrays, 1 tensor
    if len(read) != gguf_tensor_count(path):  # MLX silently skips some types it cannot read
        raise _refuse_gguf(path, "some tensors could not be read")
    config = gguf_config(metadata)
    tensors = {_gguf_name(k): v for k, v in raw.items()}
    if config["model_type"] == "llama":
        for proj, heads in (("q_proj", config["num_attention_heads"]), ("k_proj", config["num_key_value_heads"])):
            for name in [n for n in tensors if f"self_attn.{proj}." in n]:
                tensors[name] = undo_llama_cpp_permutation(tensors[name], heads)
    quantized = {}
    for name, scales in tensors.items():
        if name.endswith(".scales"):
            layer = name[: -len(".scales")]
            packed_cols = tensors[f"{layer}.weight"].shape[-1]
            bits = packed_cols * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)
            quantized[layer] = QuantSpec(GGUF_GROUP_SIZE, bits)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    return Checkpoint(
        config=config, tensors=tensors, quantized=quantized,
        tokenizer=lambda: Tokenizer.from_gguf_metadata(metadata), source=path, format="gguf",
        files=[path],
    )


# ---------------------------------------------------------------- building


def default_compute_dtype() -> str:
    """float32 on the CPU (BLAS-backed; half precision is emulated there), else native."""
    return "float32" if mx.default_device() == mx.cpu else "native"


def dequantize_layers(tensors: dict[str, mx.array], quantized: dict[str, QuantSpec], dtype: mx.Dtype,
                      source: Path) -> None:
    """Unpack every quantized layer's ``weight/scales/biases`` into one ``weight`` of ``dtype``, in place."""
    for layer, spec in quantized.items():
        for part in ("weight", "biases"):
            if f"{layer}.{part}" not in tensors:
                raise CheckpointError(f"{source}: missing tensor {layer}.{part} (the layer has {layer}.scales)")
        # scales/biases go to the compute dtype first: unpacking in their stored fp16 would
        # round every weight to fp16 before the float32 copy is made
        tensors[f"{layer}.weight"] = mx.dequantize(
            tensors.pop(f"{layer}.weight"), tensors.pop(f"{layer}.scales").astype(dtype),
            tensors.pop(f"{layer}.biases").astype(dtype), group_size=spec.group_size, bits=spec.bits,
        )


def _dequantize_all(ckpt: Checkpoint, dtype: mx.Dtype) -> None:
    dequantize_layers(ckpt.tensors, ckpt.quantized, dtype, ckpt.source)
    ckpt.quantized = {}


def _native_dtype(ckpt: Checkpoint) -> mx.Dtype:
    """The activation dtype the checkpoint was made for: its float weights', or fp16 for GGUF."""
    if ckpt.format == "gguf":
        return mx.float16
    floats = [t.dtype for t in ckpt.tensors.values() if mx.issubdtype(t.dtype, mx.floating)]
    return max(set(floats), key=floats.count) if floats else mx.float32


def check_tensors(expected: dict[str, mx.array], given: dict[str, mx.array], source: Path) -> None:
    missing = sorted(set(expected) - set(given))
    extra = sorted(set(given) - set(expected))
    if missing:
        raise CheckpointError(
            f"{source}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
            "the checkpoint is incomplete or belongs to another architecture"
        )
    if extra:
        raise CheckpointError(
            f"{source}: unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} that "
            "this architecture does not have; check config.json matches the weights"
        )
    for name, want in expected.items():
        if tuple(given[name].shape) != tuple(want.shape):
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(given[name].shape)}, the config implies "
                f"{tuple(want.shape)}; config.json and the weights disagree"
            )


def _materialize(tensors: dict[str, mx.array], source: Path) -> None:
    """Evaluate the (lazy) converted tensors one by one, with a progress bar."""
    total = sum(v.nbytes for v in tensors.values())
    with _progress(total, f"preparing {source.name}") as bar:
        for value in tensors.values():
            mx.eval(value)
            bar.update(value.nbytes)


def build_target(ckpt: Checkpoint, dtype: str = "auto") -> tuple[DecoderModel, str]:
    """Build and load the model; returns it with the compute dtype's name."""
    args = decoder_args(ckpt.config)
    choice = default_compute_dtype() if dtype == "auto" else dtype
    if choice != "native" and choice not in DTYPES:
        raise CheckpointError(f"unknown dtype {dtype!r}: use auto, native, {', '.join(DTYPES)}")
    compute = _native_dtype(ckpt) if choice == "native" else DTYPES[choice]
    if choice != "native":
        _dequantize_all(ckpt, compute)
    model = build_model(args)
    tensors = model.sanitize(dict(ckpt.tensors))
    if ckpt.quantized:
        specs = ckpt.quantized
        nn.quantize(
            model,
            class_predicate=lambda p, _m: (
                {"group_size": specs[p].group_size, "bits": specs[p].bits} if p in specs else False
            ),
        )
    check_tensors(dict(tree_flatten(model.parameters())), tensors, ckpt.source)
    cast = {k: (v if v.dtype == mx.uint32 else v.astype(compute)) for k, v in tensors.items()}
    _materialize(cast, ckpt.source)
    model.load_weights(list(cast.items()), strict=True)
    model.eval()
    return model, str(compute).split(".")[-1]


def read_checkpoint(path: str | Path) -> Checkpoint:
    if isinstance(path, str) and path.startswith(RANDOM_TARGET_PREFIX):
        from .random_targets import random_checkpoint  # it builds on this module

        return random_checkpoint(path)
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"{path} does not exist: give a model folder or a .gguf file")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf; give a folder for safetensors")
        return read_gguf(path)
    return read_hf_folder(path)


def load_target(path: str | Path, dtype: str = "auto", fuse: bool = True) -> LoadedModel:
    """Load a target model and its tokenizer from a folder or a GGUF file.

    ``fuse`` computes q/k/v and gate/up in one matmul each (fewer ops per forward); the
    model's parameters then no longer carry the checkpoint's names (export with fuse=False).
    """
    return load_checkpoint(read_checkpoint(path), dtype, fuse)


def load_checkpoint(ckpt: Checkpoint, dtype: str = "auto", fuse: bool = True) -> LoadedModel:
    """:func:`load_target` for a checkpoint already read."""
    tokenizer = ckpt.tokenizer()
    model, compute = build_target(ckpt, dtype)
    if fuse:
        model.fuse_projections()
        model.use_batch_invariant_projections()
    return LoadedModel(
        model=model, tokenizer=tokenizer, config=ckpt.config, source=ckpt.source,
        format=ckpt.format, compute_dtype=compute, quantized=bool(ckpt.quantized),
        files=ckpt.files,
    )


# ---------------------------------------------------------------- DFlash drafters


def load_drafter(path: str | Path, target: LoadedModel, fuse: bool = True) -> DFlashDrafter:
    """Load a z-lab-format drafter folder, DFlash 1 or 2 (or one packed by ``runtime.training.pack``),
    in the target's compute dtype, bound to it.

    ``fuse``: for inference, fewer ops per draft (``DFlashDrafter.fuse_projections``);
    a drafter to train further is loaded with fuse=False.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a drafter folder (config.json + model.safetensors)")
    config = _read_json(folder / "config.json")
    args = drafter_args(config)
    tensors = read_safetensors(safetensors_files(folder), f"loading {folder.name}")
    dtype = DTYPES[target.compute_dtype]
    # a drafter packed in fewer bits to fit a size limit (runtime.training.pack) runs unpacked
    dequantize_layers(tensors, quantized_layers(tensors, config), dtype, folder)
    drafter = DFlashDrafter(args)
    params, names = dict(tree_flatten(drafter.parameters())), drafter.checkpoint_names()
    check_tensors({stored: params[name] for stored, name in names.items()}, tensors, folder)
    drafter.load_weights([(names[k], v.astype(dtype)) for k, v in tensors.items()], strict=True)
    mx.eval(drafter.parameters())
    drafter.eval()
    if fuse:
        drafter.fuse_projections()
    return drafter.bind(target.model)
