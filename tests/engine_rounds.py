"""Checking that every engine mode makes the reference loop's rounds (tests of rounds with several blocks)."""

from __future__ import annotations

from pathlib import Path

import anyio

from protocol import GenerationParams
from runtime.bench import run_together
from runtime.engine import MODES
from runtime.loading import LoadedModel
from runtime.models.dflash import DFlashDrafter
from runtime.replay.reading import read_log

Round = tuple[int, int, list[int]]  # accepted, block kept, tokens committed


def assert_every_mode_makes_these_rounds(target: LoadedModel, drafter: DFlashDrafter, ids: list[list[int]],
                                         params: GenerationParams, branches: int, reference: list[list[Round]],
                                         want: list[list[int]], folder: Path) -> None:
    """The prompts batched through every engine mode: plain greedy's output (``want``) and, by
    the round logs, the reference loop's rounds of each request."""
    for mode in MODES:
        log = folder / f"{mode}.jsonl"
        group = anyio.run(run_together, target, drafter, ids, params, mode, log, branches)
        assert [tokens for tokens, _ in group.results] == want, mode
        rounds = [[(r.accepted, r.branch, r.committed) for r in request.rounds] for request in read_log(log).requests.values()]
        assert sorted(rounds) == sorted(reference), mode
