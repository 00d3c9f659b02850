"""Target model families and the DFlash drafter.

Each family module (llama.py, qwen3.py) is a model file in mlx-lm's shape and exposes
``ARCHITECTURES``, ``MODEL_TYPES``, ``ModelArgs``, ``Model`` and ``args_from_config``;
every ``Model`` is a :class:`DecoderModel`, the runtime's one interface to a target
(runtime/models/decoder.py).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..errors import CheckpointError, UnsupportedArchitectureError
from . import llama, qwen3
from .base import DecoderArgs
from .decoder import DecoderModel, ForwardOutput

FAMILIES: tuple[ModuleType, ...] = (llama, qwen3)


def family_for(config: dict[str, Any]) -> ModuleType:
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    for family in FAMILIES:
        if any(a in family.ARCHITECTURES for a in architectures) or model_type in family.MODEL_TYPES:
            return family
    known = sorted(a for f in FAMILIES for a in f.ARCHITECTURES)
    raise UnsupportedArchitectureError(
        f"unknown architecture {architectures or model_type!r}: this runtime implements {known}; "
        "convert the checkpoint to one of them or add a family module under runtime/models/"
    )


def decoder_args(config: dict[str, Any]) -> DecoderArgs:
    family = family_for(config)
    try:
        return family.args_from_config(config)
    except KeyError as exc:
        raise CheckpointError(
            f"config.json lacks the field {exc.args[0]!r} that a {family.__name__.split('.')[-1]} "
            "model needs; check that the folder holds the model's original config.json"
        ) from None


def build_model(args: DecoderArgs) -> DecoderModel:
    """The family's ``Model`` for ``args`` (from :func:`decoder_args`)."""
    family = next(f for f in FAMILIES if args.model_type in f.MODEL_TYPES)
    return family.Model(args)


__all__ = ["DecoderArgs", "DecoderModel", "ForwardOutput", "build_model", "decoder_args", "family_for"]
