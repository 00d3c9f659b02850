"""Where a drafter misses: its teacher-forced hits by block row and by the target's confidence.

    PYTHONPATH=. python benchmarks/row-confidence.py --draft DRAFTER --prompts SET.jsonl ... [--max-tokens 256]

For each prompt the target decodes greedily (as plain decoding does); then every response
position that has a whole block after it is an anchor, and one teacher-forced pass scores
the drafter's rows there (what a round anchored at that position would draft, had all
earlier rounds been accepted). Per set it prints, over every anchor and over the anchors a
decode meets (each round starts where the previous one's accepted run ended, so mostly just
past a miss: training samples anchors uniformly, decoding does not):
- hits by block row 1..4 (top-1 equal to the target's greedy token) and, from the leading
  runs of hits, tau (over the decoded rounds, it is the reference loop's, but for the
  last rounds of a response, which have no whole block);
- row 1's misses at decoded rounds, and how many drafted the token after the right one or what
  the target would say after its runner-up for the anchor (two guesses at why it misses);
- row 1's hit rate by the target's own top-1 probability for that token (computed at the
  anchor position, the step a plain decode would take): a miss where the target is sure
  is something the drafter could learn; a miss where it hesitates between near-ties is
  one that only the target's own computation settles;
- tau had each round verified several blocks (a tree of drafts: row 1's K best tokens, or rows 1
  and 2's, or one runner-up in one of rows 1-3; every other row its best), the decode chain
  recomputed for each shape: what branching could buy, since a miss in an early row costs most
  of a round.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import runtime  # noqa: F401  (first: on Linux it binds MLX's CPU matmuls to OpenBLAS before MLX loads)

import mlx.core as mx
import numpy as np
from protocol import GenerationParams

from runtime.bench import read_prompts, run_plain
from runtime.defaults import default_model_path
from runtime.drafters import resolve_drafter
from runtime.loading import LoadedModel, load_target
from runtime.models.dflash import DFlashDrafter
from runtime.training.batches import block_labels, candidate_anchors, decoded_rounds, leading_hits
from runtime.training.data import Example
from runtime.training.trainer import candidate_drafts

CONFIDENCE_EDGES = (0.0, 0.5, 0.8, 0.95, 1.01)
ANCHORS_PER_PASS = 64  # bounds a pass's logits: anchors x (B-1) rows x vocabulary
TOP = 8  # the drafter's best tokens a row keeps for TREES
# blocks a round would verify, each as the drafter's rank of the token in rows 1, 2, ... (later rows: its best)
TREES = {
    "row 1's best 2": [(0,), (1,)],
    "row 1's best 4": [(i,) for i in range(4)],
    "row 1's best 8": [(i,) for i in range(8)],
    "rows 1-2's best 2x2": [(i, j) for i in range(2) for j in range(2)],
    "rows 1-2's best 4x2": [(i, j) for i in range(4) for j in range(2)],
    "a runner-up in row 1, 2 or 3 (4 blocks)": [(0,), (1,), (0, 1), (0, 0, 1)],
}


def runner_up_continues(target: LoadedModel, tokens: list[int], anchor: int, runner_up: int, drafted: int) -> bool:
    """Whether ``drafted`` is what the target would say after its runner-up for the anchor's position."""
    out = target.model(mx.array([tokens[:anchor] + [runner_up]]), last_only=True)
    return int(mx.argmax(out.logits[0, -1]).item()) == drafted


def met_by(hits: np.ndarray) -> np.ndarray:
    """Which of a sequence's consecutive anchors a decode with these hits ``[A, B-1]`` meets ``[A]``."""
    meets = np.zeros(len(hits), dtype=bool)
    meets[decoded_rounds(hits)] = True
    return meets


def tree_hits(best: np.ndarray, labels: np.ndarray, tree: list[tuple[int, ...]]) -> np.ndarray:
    """Hits ``[A, B-1]`` of rounds that verify every block of ``tree`` (ranks into the drafter's
    best tokens ``best [A, B-1, top]``) and keep the one accepted furthest."""
    accepted, top1 = np.zeros(len(labels), dtype=np.int64), best[..., 0] == labels
    for ranks in tree:
        hits = top1.copy()
        for row, rank in enumerate(ranks):
            hits[:, row] = best[:, row, rank] == labels[:, row]
        accepted = np.maximum(accepted, leading_hits(hits))
    return np.arange(labels.shape[1])[None, :] < accepted[:, None]


def score_sequence(target: LoadedModel, drafter: DFlashDrafter, prompt_ids: list[int],
                   response_ids: list[int]) -> tuple[np.ndarray, ...]:
    """Per anchor: the hits of rows 1..B-1 ``[A, B-1]``, the target's top-1 probability for row 1's
    token ``[A]``, whether a decode's round starts there ``[A]``, and, where it does and row 1
    misses, whether row 1 drafted the token after the right one ``[A]`` or the target's own
    continuation of its runner-up for the anchor ``[A]``; and per tree of :data:`TREES`, the drafts a
    round verifying it accepts ``[A, len(TREES)]`` and whether a decode with such rounds meets the
    anchor ``[A, len(TREES)]``."""
    example = Example("", prompt_ids, response_ids, "", "eval")
    anchors = candidate_anchors(len(prompt_ids), len(example), drafter.block_size)
    out = target.model(mx.array([example.tokens]), tap_layers=drafter.tap_layers, last_only=False)
    probs = mx.softmax(out.logits[0].astype(mx.float32), axis=-1)
    sure = np.array(mx.max(probs, axis=-1))[anchors]  # position a predicts x[a+1]: row 1's label
    agrees = np.array(mx.argmax(probs, axis=-1))[anchors] == np.asarray(example.tokens)[anchors + 1]
    if len(anchors) and agrees.mean() < 0.95:  # the scoring is misaligned with decoding: its figures would mean nothing
        raise SystemExit(f"the target's top-1 agrees with its greedy token at only {agrees.mean():.0%} of anchors")
    best = candidate_drafts(drafter, [example], out.taps.astype(mx.float32), ANCHORS_PER_PASS, TOP)[0]
    x, drafted = np.asarray(example.tokens), best[..., 0]
    labels = block_labels(example.tokens, anchors, drafter.block_size)[0]
    hits = drafted == labels
    trees = [tree_hits(best, labels, tree) for tree in TREES.values()]
    tree_accepted = np.stack([leading_hits(h) for h in trees], axis=1)
    tree_meets = np.stack([met_by(h) for h in trees], axis=1)
    meets = met_by(hits)
    skipped, runner_up = np.zeros(len(hits), dtype=bool), np.zeros(len(hits), dtype=bool)
    for i in np.flatnonzero(meets & ~hits[:, 0]):
        a = int(anchors[i])
        skipped[i] = drafted[i, 0] == x[a + 2]
        second = int(mx.argsort(-out.logits[0, a - 1])[1].item())  # the target's runner-up for x[a]
        runner_up[i] = runner_up_continues(target, example.tokens, a, second, int(drafted[i, 0]))
    return hits, sure, meets, skipped, runner_up, tree_accepted, tree_meets


def report(name: str, hits: np.ndarray, sure: np.ndarray, meets: np.ndarray, skipped: np.ndarray,
           runner_up: np.ndarray, tree_accepted: np.ndarray, tree_meets: np.ndarray) -> None:
    """Figures over every anchor, then over the anchors decoding meets (the ones tau counts)."""
    print(f"{name}:")
    for label, pick in (("every anchor", np.ones(len(hits), dtype=bool)), ("decoded rounds", meets)):
        h, p = hits[pick], sure[pick]
        accepted = leading_hits(h)
        rows = " ".join(f"{h[:, k].mean():.2f}" for k in range(4))
        print(f"  {label}: {len(h)}, hits by row 1-4 {rows}, tau {1 + accepted.mean():.3f}")
        for lo, hi in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]):
            inside = (p >= lo) & (p < hi)
            if inside.any():
                print(f"    target p(top-1) {lo:.2f}-{min(hi, 1.0):.2f}: {inside.mean():6.1%} of them, row 1 hits "
                      f"{h[inside, 0].mean():.2f}, {(~h[inside, 0]).sum() / max((~h[:, 0]).sum(), 1):6.1%} of row 1's misses")
    missed = meets & ~hits[:, 0]
    print(f"  row 1's misses at decoded rounds: {missed.sum()} ({(missed & (sure >= 0.9)).sum()} where the target's "
          f"p >= 0.9); it drafted the token after the right one in {skipped.sum()}, the target's own continuation "
          f"of its runner-up for the anchor in {runner_up.sum()}")
    for i, name in enumerate(TREES):
        print(f"  rounds verifying {name}: tau {1 + tree_accepted[tree_meets[:, i], i].mean():.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--prompts", nargs="+", required=True, type=Path)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    target = load_target(default_model_path(), dtype="float32")
    drafter = resolve_drafter(args.draft, target, block_size=16)
    params = GenerationParams(max_tokens=args.max_tokens)
    for path in args.prompts:
        scored = [score_sequence(target, drafter, ids, run_plain(target, ids, params).token_ids)
                  for _, ids in read_prompts(path, target)]
        report(path.stem, *(np.concatenate(parts) for parts in zip(*scored)))


if __name__ == "__main__":
    main()
