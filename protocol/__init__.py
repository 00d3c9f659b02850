"""Every message that crosses an actor channel, and every log record, as msgspec Structs."""

from .params import GenerationParams

__all__ = ["GenerationParams"]
