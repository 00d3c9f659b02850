"""Reading a run log: every readable record, grouped by request; every unreadable line named.

A log is appended to by each engine that wrote it and may end in a half-written line (a
run that was killed), so a bad line is reported with its number and the rest still used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import msgspec

from protocol import SCHEMA_VERSION, FinishRecord, LogRecord, ProtocolError, RequestRecord, RoundRecord, records
from runtime.errors import RuntimeErrorBase

RECORD_TAGS = tuple(kind.__struct_config__.tag for kind in get_args(LogRecord))


@dataclass
class LogProblem:
    line: int
    message: str


@dataclass
class RequestLog:
    """One request's records, in the order the committer wrote them."""

    key: str  # its request id; "#2", "#3"... when a later engine appended to the same log reused the id
    request: RequestRecord | None = None
    rounds: list[RoundRecord] = field(default_factory=list)
    finish: FinishRecord | None = None


@dataclass
class ReplayLog:
    path: Path
    lines: int
    requests: dict[str, RequestLog]
    problems: list[LogProblem]


def read_log(path: str | Path) -> ReplayLog:
    path = Path(path)
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the newline that ends the last complete record
    complete = data.endswith(b"\n")
    requests: dict[str, RequestLog] = {}
    current: dict[str, RequestLog] = {}  # request id -> its latest instance
    problems: list[LogProblem] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = records.from_json(line)
        except ProtocolError as exc:
            half_written = number == len(lines) and not complete
            problems.append(LogProblem(number, _why_unreadable(line, exc, half_written)))
            continue
        _add(record, requests, current)
    return ReplayLog(path, len(lines), requests, problems)


def _add(record: LogRecord, requests: dict[str, RequestLog], current: dict[str, RequestLog]) -> None:
    log = current.get(record.request_id)
    if log is None or (isinstance(record, RequestRecord) and log.request is not None):
        key = record.request_id
        n = 1
        while key in requests:  # ids restart at req-0 in every engine appending to the log
            n += 1
            key = f"{record.request_id}#{n}"
        log = current[record.request_id] = requests[key] = RequestLog(key)
    if isinstance(record, RequestRecord):
        log.request = record
    elif isinstance(record, RoundRecord):
        log.rounds.append(record)
    else:
        log.finish = record


def _why_unreadable(line: bytes, exc: ProtocolError, half_written: bool) -> str:
    """Say what is wrong in the reader's terms, not only the decoder's."""
    try:
        raw = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return "half-written last line (the run was cut off)" if half_written else f"invalid JSON: {exc}"
    if not isinstance(raw, dict):
        return f"not a record (a JSON {type(raw).__name__})"
    if raw.get("v", SCHEMA_VERSION) != SCHEMA_VERSION:
        return f"unknown schema version {raw['v']!r} (this replay reads version {SCHEMA_VERSION})"
    if raw.get("event") not in RECORD_TAGS:
        return f"unknown record type {raw.get('event')!r} (known: {', '.join(RECORD_TAGS)})"
    return f"malformed {raw['event']} record: {exc}"


@dataclass(frozen=True)
class RoundWindow:
    """The rounds a replay reports on: ``A:B`` is rounds A to B-1, as in a Python slice."""

    start: int = 0
    stop: int | None = None

    @classmethod
    def parse(cls, text: str) -> "RoundWindow":
        start, sep, stop = text.partition(":")
        try:
            first = int(start) if start else 0
            if not sep:
                return cls(first, first + 1)  # "A": round A alone
            return cls(first, int(stop) if stop else None)
        except ValueError:
            raise ValueError(f"--rounds takes A:B, A: , :B or A (round numbers), not {text!r}") from None

    def __str__(self) -> str:
        return f"{self.start}:{'' if self.stop is None else self.stop}"

    def __contains__(self, round: object) -> bool:
        return isinstance(round, int) and round >= self.start and (self.stop is None or round < self.stop)

    def of(self, log: RequestLog) -> list[RoundRecord]:
        return [r for r in log.rounds if r.round in self]


class ReplayError(RuntimeErrorBase):
    """A replay that cannot be done as asked (a request not in the log, a rerun refused)."""
