"""Re-running logged requests on the models the log names, to find the first round that differs.

The weights must be the ones that ran (the log's sha256 of each checkpoint); a changed
checkpoint is refused unless the caller asks to see where it diverges. Each request is
run again with its logged prompt, parameters (seed included) and mode, into a fresh log
that is then read back like the original.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import anyio

from protocol import ModelIdentity, RequestRecord, RoundRecord
from runtime.engine import Engine
from runtime.loading import LoadedModel, hash_folder, load_drafter, load_target
from runtime.sampling import is_greedy

from .reading import ReplayError, RequestLog, RoundWindow, read_log

COMPARED = ("drafts", "target_tokens", "accepted")  # what decides a round; timings always differ


@dataclass
class RoundDiff:
    round: int
    fields: list[str]  # the COMPARED fields that differ; ["round"] when one run has no such round
    logged: RoundRecord | None
    rerun: RoundRecord | None


@dataclass
class RerunResult:
    request: str
    first_difference: RoundDiff | None
    logged_output: list[int]
    rerun_output: list[int]
    note: str | None = None


def first_difference(logged: list[RoundRecord], rerun: list[RoundRecord], window: RoundWindow) -> RoundDiff | None:
    for i in range(max(len(logged), len(rerun))):
        if i not in window:
            continue
        a = logged[i] if i < len(logged) else None
        b = rerun[i] if i < len(rerun) else None
        if a is None or b is None:
            return RoundDiff(i, ["round"], a, b)
        fields = [f for f in COMPARED if getattr(a, f) != getattr(b, f)]
        if fields:
            return RoundDiff(i, fields, a, b)
    return None


def _check_hash(role: str, identity: ModelIdentity, now: str, allow_changed: bool) -> None:
    if now != identity.sha256 and not allow_changed:
        raise ReplayError(
            f"the {role} at {identity.path} is not the one that ran: the log names sha256 {identity.sha256[:16]}..., "
            f"the files there now hash to {now[:16]}...; put the logged weights back, or pass "
            "--allow-changed-weights to rerun anyway and see the first round that differs")


def _drafter_identity(request: RequestRecord, allow_changed: bool) -> ModelIdentity:
    """The drafter checkpoint as it is now, after checking it is the one that ran."""
    logged = request.drafter
    if logged is None:
        raise ReplayError(
            f"request {request.request_id} ran a drafter the log names no checkpoint for (a random:L drafter, or "
            "an Engine built without a drafter identity): there are no weights to rerun it with")
    folder = Path(logged.path)
    if not folder.is_dir():
        raise ReplayError(f"the drafter folder {folder} that the log names does not exist")
    now = hash_folder(folder)
    _check_hash("drafter", logged, now, allow_changed)
    return ModelIdentity(logged.name, logged.path, logged.format, now)


def _load(request: RequestRecord, allow_changed: bool, dtype: str) -> tuple[LoadedModel, ModelIdentity]:
    drafter = _drafter_identity(request, allow_changed)  # cheap checks before loading anything
    target = load_target(request.target.path, dtype=dtype)
    _check_hash("target", request.target, target.content_hash(), allow_changed)
    return target, drafter


async def _generate_all(engine: Engine, requests: list[RequestRecord]) -> None:
    async with engine:
        for request in requests:  # one at a time: a round's outcome does not depend on its neighbours
            async for _ in engine.generate(request.prompt_ids, request.params):
                pass


def _rerun_group(logs: list[RequestLog], allow_changed: bool, dtype: str) -> list[RequestLog]:
    requests = [log.request for log in logs if log.request is not None]
    first = requests[0]
    target, identity = _load(first, allow_changed, dtype)
    drafter = load_drafter(identity.path, target)
    with tempfile.TemporaryDirectory(prefix="dflash-rerun-") as tmp:
        path = Path(tmp) / "rerun.jsonl"
        anyio.run(_generate_all, Engine(target, drafter, mode=first.mode, log=path, drafter_identity=identity), requests)
        return list(read_log(path).requests.values())  # in the order they ran


def _group_key(request: RequestRecord) -> tuple[object, ...]:
    return request.target, request.drafter, request.mode


def rerun_requests(logs: list[RequestLog], window: RoundWindow, *, allow_changed_weights: bool = False,
                   dtype: str = "auto") -> list[RerunResult]:
    """Run every request again, one engine per (target, drafter, mode), and compare round by round."""
    missing = [log.key for log in logs if log.request is None]
    if missing:
        raise ReplayError(f"no request record for {', '.join(missing)}: its prompt and parameters are lost")
    groups: dict[tuple[object, ...], list[RequestLog]] = {}
    for log in logs:
        assert log.request is not None
        groups.setdefault(_group_key(log.request), []).append(log)
    results = []
    for group in groups.values():
        for old, new in zip(group, _rerun_group(group, allow_changed_weights, dtype)):
            results.append(_compare(old, new, window))
    return results


def _compare(old: RequestLog, new: RequestLog, window: RoundWindow) -> RerunResult:
    assert old.request is not None
    params = old.request.params
    unseeded = not is_greedy(params) and params.seed is None
    return RerunResult(
        old.key, first_difference(old.rounds, new.rounds, window),
        old.finish.token_ids if old.finish else [], new.finish.token_ids if new.finish else [],
        "sampled without a seed: a rerun draws other tokens" if unseeded else None,
    )
