"""msgpack and JSON codecs for every message and record, with clear rejection of bad input."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from .messages import SCHEMA_VERSION, ActorMessage
from .records import LogRecord

T = TypeVar("T")


class ProtocolError(ValueError):
    """Input that is not a message or record of this schema version."""


def _check_version(obj: Any) -> Any:
    if getattr(obj, "v", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ProtocolError(f"schema version {obj.v} is not supported (this runtime speaks {SCHEMA_VERSION})")
    return obj


class Codec:
    """Encode/decode one union of Structs as JSON or msgpack."""

    def __init__(self, kind: Any) -> None:
        self._json = msgspec.json.Decoder(kind)
        self._msgpack = msgspec.msgpack.Decoder(kind)
        self._json_encoder = msgspec.json.Encoder()
        self._msgpack_encoder = msgspec.msgpack.Encoder()

    def to_json(self, obj: msgspec.Struct) -> bytes:
        return self._json_encoder.encode(obj)

    def to_msgpack(self, obj: msgspec.Struct) -> bytes:
        return self._msgpack_encoder.encode(obj)

    def from_json(self, data: bytes | str) -> Any:
        try:
            return _check_version(self._json.decode(data))
        except msgspec.DecodeError as exc:
            raise ProtocolError(str(exc)) from None

    def from_msgpack(self, data: bytes) -> Any:
        try:
            return _check_version(self._msgpack.decode(data))
        except msgspec.DecodeError as exc:
            raise ProtocolError(str(exc)) from None


messages = Codec(ActorMessage)
records = Codec(LogRecord)
