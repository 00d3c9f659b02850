"""Target model families and the DFlash drafter.

Each family module exposes ``ARCHITECTURES``, ``MODEL_TYPES`` and ``args_from_config``;
all of them build the same :class:`DecoderModel`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from ..errors import CheckpointError, UnsupportedArchitectureError
from . import llama, qwen3
from .base import DecoderArgs, DecoderModel, ForwardOutput

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


__all__ = ["DecoderArgs", "DecoderModel", "ForwardOutput", "decoder_args", "family_for"]
