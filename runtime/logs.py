"""Round logs: structlog JSON lines, one record per request, per round and per finish.

Records are the msgspec Structs of protocol/records.py; structlog renders each as one
JSON line (its ``event`` key is the record's tag), cheap enough to leave on.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import msgspec
import structlog

_encode = msgspec.json.Encoder()


def _serialize(event: dict[str, Any], **_: Any) -> str:
    return _encode.encode(event).decode()


class RunLog:
    """Appends records to a JSONL file; ``close`` flushes it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = open(self.path, "a", buffering=1 << 16)
        self._logger = structlog.wrap_logger(
            structlog.WriteLogger(self._file),
            processors=[structlog.processors.JSONRenderer(serializer=_serialize)],
        )

    def write(self, record: msgspec.Struct) -> None:
        fields = msgspec.structs.asdict(record)
        tag = type(record).__struct_config__.tag
        self._logger.msg(tag, **msgspec.to_builtins(fields))

    def close(self) -> None:
        self._file.close()
