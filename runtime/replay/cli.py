"""The command line: read, audit, summarise, and optionally trace and rerun a run log.

    python -m runtime.replay run.jsonl
    python -m runtime.replay run.jsonl --request req-3 --rounds 10:20 --trace run.trace.json
    python -m runtime.replay run.jsonl --rerun [--allow-changed-weights] --json

Exit status: 0 when the log is readable, every round passes and (with --rerun) nothing
differs; 1 otherwise; 2 when the replay cannot be done (run_cli's convention).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec

from .audit import audit_request
from .reading import ReplayError, ReplayLog, RequestLog, RoundWindow, read_log
from .report import Report, render
from .summary import round_rows, summarize
from .trace import write_trace
from ..cli import new_parser


def _window(text: str) -> RoundWindow:
    try:
        return RoundWindow.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = new_parser("python -m runtime.replay", __doc__)
    parser.add_argument("log", type=Path, help="a run log (JSONL) written by Engine(log=...)")
    parser.add_argument("--request", help="only this request id (req-0#2: the id's second use in an appended log)")
    parser.add_argument("--rounds", type=_window, default=RoundWindow(), metavar="A:B",
                        help="report on rounds A..B-1 only (the audit still runs from round 0)")
    parser.add_argument("--trace", type=Path, metavar="OUT.json", help="write a Chrome/Perfetto trace of the rounds")
    parser.add_argument("--rerun", action="store_true", help="run the requests again on the logged models and compare")
    parser.add_argument("--allow-changed-weights", action="store_true",
                        help="with --rerun: rerun even if a checkpoint's sha256 differs from the log's")
    parser.add_argument("--dtype", default="auto", help="with --rerun: compute dtype (the log does not record it)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args(argv)


def _select(log: ReplayLog, request: str | None) -> list[RequestLog]:
    if request is None:
        return list(log.requests.values())
    if request not in log.requests:
        known = ", ".join(list(log.requests)[:10]) or "none"
        raise ReplayError(f"request {request!r} is not in {log.path} (requests: {known})")
    return [log.requests[request]]


def build_report(args: argparse.Namespace) -> Report:
    if not args.log.is_file():
        raise ReplayError(f"{args.log} is not a file: give the JSONL log an Engine(log=...) wrote")
    log = read_log(args.log)
    logs = _select(log, args.request)
    window = args.rounds
    findings = [f for one in logs for f in audit_request(one) if f.round is None or f.round < 0 or f.round in window]
    report = Report(str(log.path), log.lines, log.problems, findings, summarize(logs, window),
                    str(window),
                    requests=[one.key for one in logs])
    if args.request is not None:
        report.rounds = round_rows(logs[0], window)
    if args.trace is not None:
        write_trace(args.trace, logs, window)
        report.trace = str(args.trace)
    if args.rerun:
        from .rerun import rerun_requests  # loads MLX and the models: only when asked

        report.rerun = rerun_requests(logs, window, allow_changed_weights=args.allow_changed_weights, dtype=args.dtype)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = build_report(args)
    if args.json:
        print(msgspec.json.encode({**msgspec.to_builtins(report), "ok": report.ok}).decode())
    else:
        print(render(report))
    return 0 if report.ok else 1
