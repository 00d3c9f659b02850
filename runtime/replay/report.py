"""A replay's findings and summary, and their rendering as text for a terminal."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .audit import Finding
from .reading import LogProblem
from .summary import STAGES, Summary

if TYPE_CHECKING:
    from .rerun import RerunResult, RoundDiff  # imports MLX: only a --rerun loads it

INVARIANTS = "lag, trim, no-rollback, layout and accepted-prefix"


@dataclass
class Report:
    log: str
    lines: int
    problems: list[LogProblem]
    findings: list[Finding]
    summary: Summary
    window: str
    requests: list[str] = field(default_factory=list)
    rounds: list[dict[str, Any]] | None = None  # the round-by-round listing of one request (--request)
    trace: str | None = None
    rerun: list[RerunResult] | None = None

    @property
    def ok(self) -> bool:
        differs = any(r.first_difference or r.logged_output != r.rerun_output for r in self.rerun or [])
        return not (self.problems or self.findings or differs)


def render(report: Report) -> str:
    lines = [f"replay of {report.log}: {report.lines} lines, {len(report.requests)} request(s), rounds {report.window}"]
    lines += [f"  line {p.line}: {p.message}" for p in report.problems] or ["  every line readable"]
    lines += _audit(report.findings)
    lines += _summary(report.summary)
    if report.rounds is not None:
        lines += _round_table(report.rounds)
    if report.trace is not None:
        lines.append(f"trace written to {report.trace} (open it in ui.perfetto.dev or chrome://tracing)")
    if report.rerun is not None:
        lines += _rerun(report.rerun)
    return "\n".join(lines)


def _audit(findings: list[Finding]) -> list[str]:
    if not findings:
        return [f"audit: every round passes the {INVARIANTS} checks; every output rebuilds exactly"]
    out = [f"audit: {len(findings)} finding(s)"]
    for f in findings:
        where = "" if f.round is None else (" prefill" if f.round < 0 else f" round {f.round}")
        out.append(f"  {f.request}{where}: {f.check}: {f.message}")
    return out


def _summary(s: Summary) -> list[str]:
    reasons = ", ".join(f"{k} {v}" for k, v in s.finish_reasons.items()) or "none finished"
    discarded = "not logged" if s.discarded_rounds is None else str(s.discarded_rounds)
    idle = s.gpu_idle_ms
    out = [
        "summary:",
        f"  requests {s.requests} (finish: {reasons}), tokens streamed {s.tokens}",
        f"  rounds {s.rounds}: speculative {s.speculative_rounds}, discarded after the last commit {discarded}",
        f"  tau mean {s.tau_mean:.2f}; histogram " + ("  ".join(f"{t}: {n}" for t, n in s.tau_histogram.items()) or "-"),
        "  acceptance per block position " + ("  ".join(f"{k}: {a:.2f}" for k, a in enumerate(s.acceptance_per_position, 1)) or "-"),
        f"  {'stage (ms)':<28}{'mean':>9}{'p50':>9}{'p90':>9}{'max':>9}",
    ]
    for label, stats in s.stage_ms.items():
        out.append(f"  {label:<28}" + "".join(f"{stats[k]:>9.3f}" for k in ("mean", "p50", "p90", "max")))
    out.append(f"  GPU idle between rounds (ms): total {idle['total']:.3f}, mean {idle['mean']:.3f}, "
               f"max {idle['max']:.3f} over {int(idle['gaps'])} gap(s)")
    return out


def _round_table(rows: list[dict[str, Any]]) -> list[str]:
    stages = [s.label for s in STAGES]
    head = f"  {'round':>5} {'block':>5} {'acc':>3} {'spec':>4}" + "".join(f"{s.name:>9}" for s in STAGES)
    out = ["rounds (ms per stage; idle: GPU idle after the round):", head + f"{'idle':>9}  committed"]
    for row in rows:
        idle = row["idle_after_ms"]
        out.append(f"  {row['round']:>5} {row['block']:>5} {row['accepted']:>3} {'yes' if row['speculative'] else 'no':>4}"
                   + "".join(f"{row['stage_ms'][s]:>9.3f}" for s in stages)
                   + (f"{idle:>9.3f}" if idle is not None else f"{'-':>9}") + f"  {row['committed']}")
    return out


def _rerun(results: list[RerunResult]) -> list[str]:
    out = ["rerun:"]
    for r in results:
        same = r.logged_output == r.rerun_output
        output = f"output identical ({len(r.logged_output)} tokens)" if same else (
            f"output differs: logged {r.logged_output}, rerun {r.rerun_output}")
        note = f" [{r.note}]" if r.note else ""
        if r.first_difference is None:
            out.append(f"  {r.request}: every round identical; {output}{note}")
            continue
        out.append(f"  {r.request}: first difference at round {r.first_difference.round} "
                   f"({', '.join(r.first_difference.fields)}); {output}{note}")
        out += _side_by_side(r.first_difference)
    return out


def _side_by_side(diff: RoundDiff) -> list[str]:
    def value(record: Any, name: str) -> str:
        return "(no such round)" if record is None else str(getattr(record, name))

    width = max(len(value(diff.logged, f)) for f in ("drafts", "target_tokens", "accepted", "committed")) + 2
    out = [f"    {'':<14}{'logged':<{width}}rerun"]
    for name in ("drafts", "target_tokens", "accepted", "committed"):
        mark = "  <-" if name in diff.fields else ""
        out.append(f"    {name:<14}{value(diff.logged, name):<{width}}{value(diff.rerun, name)}{mark}")
    return out
