"""Rounds as a Chrome/Perfetto trace (trace-event JSON): one process per request, one track
per actor, one slice per stage per round, so the drafter working ahead of the verifier shows.

Slices on one track must nest or be disjoint. In pipelined mode round N+1's verify is queued
before round N's is read, so those two overlap partially; such a slice goes on a second
track of the same actor ("verifier (overlap 1)") rather than breaking the first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from .reading import RequestLog, RoundWindow
from .summary import STAGES

ACTORS = tuple(dict.fromkeys(s.actor for s in STAGES))
Event = dict[str, Any]


def _fits(open_ends: list[int], start: int, end: int) -> bool:
    """Whether [start, end) nests in or follows the slices still open on a track (by start order).

    Pops the slices that ended by ``start``; ``open_ends`` is the track's stack of ends.
    """
    while open_ends and open_ends[-1] <= start:
        open_ends.pop()
    return not open_ends or end <= open_ends[-1]


def _us(seconds: float, origin: float) -> int:
    return round((seconds - origin) * 1e6)


def _slices(logs: list[RequestLog], window: RoundWindow, origin: float) -> list[tuple[int, str, Event]]:
    """(pid, actor, event without tid) for every stage of every selected round, by start time."""
    out = []
    for pid, log in enumerate(logs, start=1):
        for record in window.of(log):
            for stage in STAGES:
                ts = _us(getattr(record, stage.start), origin)
                dur = max(0, _us(getattr(record, stage.end), origin) - ts)
                args = {"round": record.round, "block": record.block_size, "accepted": record.accepted,
                        "speculative": record.speculative}
                out.append((pid, stage.actor, {"name": f"{stage.name} {record.round}", "cat": stage.label,
                                              "ph": "X", "ts": ts, "dur": dur, "pid": pid, "args": args}))
    out.sort(key=lambda item: (item[2]["ts"], -item[2]["dur"]))  # a parent before the slices it holds
    return out


def _tid(actor: str, lane: int) -> int:
    return lane * len(ACTORS) + ACTORS.index(actor) + 1


def build_trace(logs: list[RequestLog], window: RoundWindow) -> dict[str, Any]:
    times = [getattr(r, s.start) for log in logs for r in window.of(log) for s in STAGES]
    origin = min(times, default=0.0)
    lanes: dict[tuple[int, str], list[list[int]]] = {}  # (pid, actor) -> each lane's open ends
    events: list[Event] = []
    for pid, actor, event in _slices(logs, window, origin):
        tracks = lanes.setdefault((pid, actor), [])
        end = event["ts"] + event["dur"]
        lane = next((i for i, ends in enumerate(tracks) if _fits(ends, event["ts"], end)), len(tracks))
        if lane == len(tracks):
            tracks.append([])
        tracks[lane].append(end)
        events.append({**event, "tid": _tid(actor, lane)})
    return {"traceEvents": _metadata(logs, lanes) + events, "displayTimeUnit": "ms"}


def _metadata(logs: list[RequestLog], lanes: dict[tuple[int, str], list[list[int]]]) -> list[Event]:
    meta: list[Event] = []
    for pid, log in enumerate(logs, start=1):
        meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"request {log.key}"}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for actor in ACTORS:
            for lane in range(max(1, len(lanes.get((pid, actor), [])))):
                tid = _tid(actor, lane)
                name = actor if lane == 0 else f"{actor} (overlap {lane})"
                meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
                meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                             "args": {"sort_index": ACTORS.index(actor) * 100 + lane}})
    return meta


def nesting_problems(trace: dict[str, Any]) -> list[str]:
    """Slices that partially overlap another on their track (a viewer would draw them wrong)."""
    tracks: dict[tuple[int, int], list[Event]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X":
            tracks.setdefault((event["pid"], event["tid"]), []).append(event)
    problems = []
    for (pid, tid), events in tracks.items():
        open_ends: list[int] = []
        for event in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
            end = event["ts"] + event["dur"]
            if not _fits(open_ends, event["ts"], end):
                problems.append(f"pid {pid} tid {tid}: {event['name']!r} [{event['ts']}, {end}) overlaps a slice "
                                f"ending at {open_ends[-1]} without nesting in it")
            open_ends.append(end)
    return problems


def write_trace(path: str | Path, logs: list[RequestLog], window: RoundWindow) -> dict[str, Any]:
    trace = build_trace(logs, window)
    problems = nesting_problems(trace)
    if problems:  # build_trace places slices so this cannot happen; never write a misleading picture
        raise AssertionError("trace slices do not nest: " + "; ".join(problems[:3]))
    Path(path).write_bytes(msgspec.json.encode(trace))
    return trace
