"""The DFlash training loop: frozen-target taps, block loss, AdamW, checkpoints that resume exactly.

One optimizer step takes ``batch_size`` sequences, processed ``micro_batch`` at a time:
each micro-batch runs the frozen target once (no gradient) for its taps, then the
drafter's training forward over all its blocks. Gradients of the weighted loss *sum*
are accumulated and divided by the batch's total weight, so the update does not depend
on how the batch was cut into micro-batches.

Parameters and AdamW state are float32 ("master" weights); with a half-precision
compute dtype the drafter that runs forward holds a cast copy, refreshed after every
update, so small late updates are not rounded away.

Everything random is a pure function of (seed, epoch, index): the data order of an
epoch and the anchors of each sequence. A checkpoint therefore needs only the step,
the weights and the optimizer state to continue exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from ..errors import RuntimeErrorBase
from ..models import DecoderModel
from ..models.dflash import DFlashDrafter
from .batches import (MicroBatch, block_labels, candidate_anchors, decoded_rounds, default_gamma, leading_hits,
                      make_micro_batch, sample_anchors, sample_lengths, spread, training_mask)
from .data import Example
from .drafter import cast_parameters

ORDER_STREAM, ANCHOR_STREAM, EVAL_STREAM, LENGTH_STREAM = 0, 1, 2, 3  # independent random streams of one seed
ANCHOR_CHOICES = ("uniform", "rounds")


class ResumeError(RuntimeErrorBase):
    """A checkpoint cannot be continued with the current settings."""


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 3
    batch_size: int = 16  # sequences per optimizer step
    micro_batch: int = 4  # sequences per forward (memory)
    anchors_per_seq: int = 64
    lr: float = 6e-4
    warmup_fraction: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: default_gamma(block_size)
    # each block's length drawn from these (each at most the drafter's block), so the drafter
    # also drafts shorter blocks well; empty: every block at the drafter's block size
    block_sizes: tuple[int, ...] = ()
    # share of each row's loss that is the KL from the target's own next-token distribution
    # (the rest: cross-entropy on its greedy token): the target's full distribution tells the
    # drafter how close the runners-up were, which a hard label does not
    distill: float = 0.0
    # "uniform": anchors drawn uniformly over the response; "rounds": first the anchors where the
    # decode loop would start its rounds with the drafter as it is at that step (simulated on the
    # sequence: mostly just past a miss, where tau is decided), then uniform ones up to the count
    anchors: str = "uniform"
    seed: int = 0
    compile: bool = True


@dataclass
class StepStats:
    step: int
    loss: float  # weighted loss (cross-entropy, with distill also the KL) per unit weight
    grad_norm: float
    lr: float
    tokens: int  # sequence tokens processed
    seconds: float


@dataclass
class EvalStats:
    loss: float
    accuracy: float  # top-1 over all supervised block rows
    acceptance: float  # teacher-forced tau: 1 + mean accepted prefix per block
    decoded: float  # the same over the rounds a decode meets (the reference loop's tau, but for the last rounds)

    def __str__(self) -> str:
        return (f"loss {self.loss:.3f}  acc {self.accuracy:.3f}  tau {self.acceptance:.2f}  "
                f"decoded rounds' tau {self.decoded:.2f}")


def lr_schedule(lr: float, total_steps: int, warmup_fraction: float) -> Callable[[mx.array], mx.array]:
    """Linear warm-up to ``lr`` over the first steps, then cosine decay to 0."""
    warmup = max(1, round(total_steps * warmup_fraction))
    # warm-up starts at lr/warmup, not 0: a first step at lr 0 would be wasted
    ramp = optim.linear_schedule(lr / warmup, lr, warmup)
    return optim.join_schedules([ramp, optim.cosine_decay(lr, max(1, total_steps - warmup))], [warmup])


def block_logits(drafter: DFlashDrafter, taps: mx.array, blocks: mx.array, anchors: mx.array,
                 lengths: mx.array | None = None) -> mx.array:
    """Logits ``[S, K, B-1, V]`` of block rows 1..B-1 (row 0, the anchor, predicts nothing);
    ``lengths [S, K]``: blocks shorter than B (their rows past it are hidden)."""
    s, k = anchors.shape
    mask = training_mask(anchors, taps.shape[1], drafter.block_size, lengths)
    hidden = drafter.training_hidden(blocks, anchors, taps, mask)
    return drafter.logits(hidden.reshape(s, k, drafter.block_size, -1)[:, :, 1:]).astype(mx.float32)


def teacher_rows(logits: mx.array, anchors: mx.array, block_size: int) -> mx.array:
    """The target's logits ``[S, K, B-1, V]`` (float32) for block rows 1..B-1 from its logits over
    whole sequences ``[S, T, V]``: row k's label ``x[a+k]`` is what position ``a+k-1`` predicts.
    Rows past a sequence's end read its last position (they carry no weight)."""
    s, t, v = logits.shape
    positions = mx.minimum(anchors[:, :, None] + mx.arange(block_size - 1)[None, None, :], t - 1)
    flat = (mx.arange(s)[:, None, None] * t + positions).reshape(-1)
    return logits.reshape(s * t, v)[flat].reshape(*positions.shape, v).astype(mx.float32)


def candidate_drafts(drafter: DFlashDrafter, examples: Sequence[Example], taps: mx.array,
                     per_pass: int, top: int = 1) -> list[np.ndarray]:
    """The drafter's best ``top`` tokens ``[A, B-1, top]`` (best first) for rows 1..B-1 at every
    anchor of each sequence, in order (:func:`candidate_anchors`), ``per_pass`` blocks a sequence
    a pass; ``taps``: the target's over the sequences (padded at the end as a micro-batch pads
    them, or not)."""
    b = drafter.block_size
    candidates = [candidate_anchors(len(e.prompt_ids), len(e), b) for e in examples]
    drafts = [np.zeros((len(c), b - 1, top), dtype=np.int64) for c in candidates]
    for start in range(0, max(map(len, candidates)), per_pass):
        chunk = [c[start : start + per_pass] for c in candidates]
        probe = make_micro_batch(examples, chunk, per_pass, b, drafter.args.mask_token_id, gamma=1.0)
        logits = block_logits(drafter, taps, probe.blocks, probe.anchors)
        best = mx.argmax(logits, axis=-1)[..., None] if top == 1 else mx.argsort(-logits, axis=-1)[..., :top]
        for found, picked, row in zip(drafts, chunk, np.array(best)):
            found[start : start + len(picked)] = row[: len(picked)]
    return drafts


def candidate_hits(drafter: DFlashDrafter, examples: Sequence[Example], taps: mx.array,
                   per_pass: int) -> list[np.ndarray]:
    """Where :func:`candidate_drafts`' top-1 tokens equal the sequence's ``[A, B-1]`` (every
    candidate's block lies inside its sequence)."""
    b = drafter.block_size
    return [drafted[..., 0] == block_labels(e.tokens, candidate_anchors(len(e.prompt_ids), len(e), b), b)[0]
            for e, drafted in zip(examples, candidate_drafts(drafter, examples, taps, per_pass))]


def can_train_on(example: Example, block_size: int) -> bool:
    """At least one anchor fits: a whole block inside the sequence, anchored in the response."""
    return len(example.response_ids) >= block_size


class Trainer:
    def __init__(self, target: DecoderModel, drafter: DFlashDrafter, train: Sequence[Example],
                 settings: TrainSettings, dtype: mx.Dtype) -> None:
        if not train:
            raise RuntimeErrorBase("no training sequence has a response of a whole block: regenerate more data")
        wrong = [b for b in settings.block_sizes if not 2 <= b <= drafter.block_size]
        if wrong:
            raise RuntimeErrorBase(f"--block-sizes {wrong}: each must be 2..{drafter.block_size} (the drafter's block)")
        if not 0.0 <= settings.distill <= 1.0:
            raise RuntimeErrorBase(f"--distill {settings.distill}: the KL's share of the loss must be within 0..1")
        if settings.anchors not in ANCHOR_CHOICES:
            raise RuntimeErrorBase(f"--anchors {settings.anchors}: one of {', '.join(ANCHOR_CHOICES)}")
        if settings.anchors == "rounds" and settings.block_sizes:
            raise RuntimeErrorBase("--anchors rounds simulates whole blocks: it cannot go with --block-sizes")
        self.target, self.drafter, self.train, self.settings, self.dtype = target, drafter, list(train), settings, dtype
        self.gamma = settings.gamma or default_gamma(drafter.block_size)
        self.steps_per_epoch = math.ceil(len(self.train) / settings.batch_size)
        self.total_steps = self.steps_per_epoch * settings.epochs
        self.master = drafter if dtype == mx.float32 else _float32_copy(drafter)
        self.schedule = lr_schedule(settings.lr, self.total_steps, settings.warmup_fraction)
        self.optimizer = optim.AdamW(
            learning_rate=self.schedule, weight_decay=settings.weight_decay, bias_correction=True,  # as torch's
        )
        self.optimizer.init(self.master.trainable_parameters())
        self.step = 0
        self._grad = nn.value_and_grad(drafter, self._distilled_loss_sum if settings.distill else self._loss_sum)
        self._apply = self._apply_update
        if settings.compile:
            # outputs too: value_and_grad writes its traced parameters into the drafter
            self._grad = mx.compile(self._grad, inputs=[drafter.state], outputs=[drafter.state])
            state = [self.optimizer.state, self.master.state] + ([] if self.master is drafter else [drafter.state])
            self._apply = mx.compile(self._apply_update, inputs=state, outputs=state)

    # ---------------------------------------------------------------- one step

    def _loss_sum(self, taps: mx.array, blocks: mx.array, anchors: mx.array, lengths: mx.array, labels: mx.array,
                  weights: mx.array) -> mx.array:
        ce = nn.losses.cross_entropy(block_logits(self.drafter, taps, blocks, anchors, lengths), labels)
        return (ce * weights).sum()

    def _distilled_loss_sum(self, taps: mx.array, blocks: mx.array, anchors: mx.array, lengths: mx.array,
                            labels: mx.array, weights: mx.array, teacher: mx.array) -> mx.array:
        """:meth:`_loss_sum` with a ``distill`` share of KL(target || drafter) per row; ``teacher``:
        the target's logits for each row's label (:func:`teacher_rows`)."""
        logits = block_logits(self.drafter, taps, blocks, anchors, lengths)
        ce = nn.losses.cross_entropy(logits, labels)
        log_p = teacher - mx.logsumexp(teacher, axis=-1, keepdims=True)
        log_q = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        kl = (mx.exp(log_p) * (log_p - log_q)).sum(axis=-1)
        share = self.settings.distill
        return (((1 - share) * ce + share * kl) * weights).sum()

    def _apply_update(self, grads: dict[str, Any], total_weight: mx.array) -> mx.array:
        grads = tree_map(lambda g: g / total_weight, grads)
        grads, norm = optim.clip_grad_norm(grads, self.settings.grad_clip)
        self.optimizer.update(self.master, grads)
        if self.master is not self.drafter:
            self.drafter.update(cast_parameters(self.master, self.dtype))
        return norm

    def target_pass(self, tokens: mx.array) -> tuple[mx.array, mx.array | None]:
        """The frozen target's taps over whole sequences and, with ``distill``, its logits (one forward)."""
        distill = bool(self.settings.distill)
        out = self.target(tokens, tap_layers=self.drafter.tap_layers, last_only=not distill)
        return out.taps.astype(self.dtype), (out.logits if distill else None)  # type: ignore[union-attr]

    def loss_inputs(self, micro: MicroBatch, taps: mx.array, logits: mx.array | None) -> tuple[mx.array, ...]:
        """What the loss takes for ``micro``: the target's taps, the blocks and labels, and with
        ``distill`` the target's logits for every label."""
        inputs = (taps, micro.blocks, micro.anchors, micro.lengths, micro.labels, micro.weights)
        return inputs + (teacher_rows(logits, micro.anchors, self.drafter.block_size),) if logits is not None else inputs

    def micro_rows(self, examples: Sequence[Example]) -> Iterator[list[int]]:
        # similar lengths together waste less padding; the summed gradient is the same
        order = sorted(range(len(examples)), key=lambda i: len(examples[i]))
        for start in range(0, len(order), self.settings.micro_batch):
            yield order[start : start + self.settings.micro_batch]

    def micro_batch(self, examples: Sequence[Example], anchors: Sequence[np.ndarray],
                    lengths: Sequence[np.ndarray] | None = None) -> MicroBatch:
        return make_micro_batch(examples, anchors, self.settings.anchors_per_seq, self.drafter.block_size,
                                self.drafter.args.mask_token_id, self.gamma, lengths)

    def candidate_hits(self, examples: Sequence[Example], taps: mx.array) -> list[np.ndarray]:
        # anchors_per_seq blocks a pass: every pass has the training step's shapes
        return candidate_hits(self.drafter, examples, taps, self.settings.anchors_per_seq)

    def round_anchors(self, examples: Sequence[Example], taps: mx.array,
                      uniform: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Each sequence's decoded rounds (spread over it where there are more than ``anchors_per_seq``),
        then its ``uniform`` anchors up to that count."""
        count, chosen = self.settings.anchors_per_seq, []
        for example, hits, fill in zip(examples, self.candidate_hits(examples, taps), uniform):
            rounds = spread(len(example.prompt_ids) + decoded_rounds(hits), count)
            extra = spread(fill[~np.isin(fill, rounds)], count - len(rounds))
            chosen.append(np.sort(np.concatenate([rounds, extra])))
        return chosen

    def batch_for(self, step: int) -> tuple[list[Example], list[np.ndarray], list[np.ndarray]]:
        """The sequences, anchors and block lengths of global step ``step``: a pure function of the seed."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.settings.seed, ORDER_STREAM, epoch]).permutation(len(self.train))
        rows = order[index * self.settings.batch_size : (index + 1) * self.settings.batch_size]
        examples = [self.train[i] for i in rows]
        anchors = [self._anchors(e, np.random.default_rng([self.settings.seed, ANCHOR_STREAM, epoch, int(i)]))
                   for e, i in zip(examples, rows)]
        lengths = [sample_lengths(len(a), self.settings.block_sizes, self.drafter.block_size,
                                  np.random.default_rng([self.settings.seed, LENGTH_STREAM, epoch, int(i)]))
                   for a, i in zip(anchors, rows)]
        return examples, anchors, lengths

    def _anchors(self, example: Example, rng: np.random.Generator) -> np.ndarray:
        return sample_anchors(len(example.prompt_ids), len(example), self.drafter.block_size,
                              self.settings.anchors_per_seq, rng)

    def train_step(self) -> StepStats:
        start = time.perf_counter()
        examples, anchors, lengths = self.batch_for(self.step)
        loss_sum, total_weight, grads = mx.array(0.0), mx.array(0.0), None
        for rows in self.micro_rows(examples):
            picked, uniform = [examples[i] for i in rows], [anchors[i] for i in rows]
            micro = self.micro_batch(picked, uniform, [lengths[i] for i in rows])
            taps, logits = self.target_pass(micro.tokens)
            if self.settings.anchors == "rounds":  # same sequences, same padding: the taps still hold
                micro = self.micro_batch(picked, self.round_anchors(picked, taps, uniform))
            loss, g = self._grad(*self.loss_inputs(micro, taps, logits))
            g = tree_map(lambda x: x.astype(mx.float32), g)  # half-precision sums would drift
            grads = g if grads is None else tree_map(mx.add, grads, g)
            loss_sum, total_weight = loss_sum + loss, total_weight + micro.weights.sum()
            mx.eval(loss_sum, total_weight, grads)  # bound the graph to one micro-batch
        norm = self._apply(grads, total_weight)
        mx.eval(norm, self.master.parameters(), self.drafter.parameters(), self.optimizer.state)
        lr = self.schedule(mx.array(self.step)).item()  # the rate this update used
        self.step += 1
        return StepStats(self.step, (loss_sum / total_weight).item(), norm.item(), lr,
                         sum(len(e) for e in examples), time.perf_counter() - start)

    # ---------------------------------------------------------------- evaluation

    def evaluate(self, examples: Sequence[Example]) -> EvalStats:
        """Teacher-forced loss, accuracy and acceptance on fixed anchors of ``examples``, and the
        acceptance over the rounds a decode meets on them."""
        ce_sum = weight_sum = correct = rows = accepted = blocks = 0.0
        round_lengths: list[np.ndarray] = []
        anchors = [self._anchors(e, np.random.default_rng([self.settings.seed, EVAL_STREAM, i]))
                   for i, e in enumerate(examples)]
        for group in self.micro_rows(examples):
            picked = [examples[i] for i in group]
            micro = self.micro_batch(picked, [anchors[i] for i in group])
            taps = self.target_pass(micro.tokens)[0]
            for found in self.candidate_hits(picked, taps):
                round_lengths.append(leading_hits(found[decoded_rounds(found)]))
            logits = block_logits(self.drafter, taps, micro.blocks, micro.anchors)
            ce = nn.losses.cross_entropy(logits, micro.labels)
            valid = micro.weights > 0
            hits = (mx.argmax(logits, axis=-1) == micro.labels) & valid
            ce_sum += (ce * micro.weights).sum().item()
            weight_sum += micro.weights.sum().item()
            correct += hits.sum().item()
            rows += valid.sum().item()
            # accepted drafts of a block: its leading run of hits, as in greedy verification
            accepted += mx.cumprod(hits.astype(mx.int32), axis=-1).sum().item()
            blocks += valid[..., 0].sum().item()
        decoded = 1 + float(np.concatenate(round_lengths).mean()) if round_lengths else 1.0
        return EvalStats(ce_sum / max(weight_sum, 1e-9), correct / max(rows, 1), 1 + accepted / max(blocks, 1), decoded)

    # ---------------------------------------------------------------- checkpoints

    def fingerprint(self, extra: dict[str, Any]) -> dict[str, Any]:
        """What must not change between a run and its resumption."""
        keys = hashlib.sha256("".join(e.key for e in self.train).encode()).hexdigest()
        # as state.json holds it (tuples come back as lists), so a resumption compares like with like
        return json.loads(json.dumps({"settings": asdict(self.settings), "train_data": keys, **extra}))

    def save_checkpoint(self, folder: Path, fingerprint: dict[str, Any]) -> None:
        """Weights, optimizer state and step, written beside ``folder`` then swapped in whole."""
        staging = folder.with_name(folder.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        mx.save_safetensors(str(staging / "weights.safetensors"), dict(tree_flatten(self.master.parameters())))
        mx.save_safetensors(str(staging / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        (staging / "state.json").write_text(json.dumps({"step": self.step, "fingerprint": fingerprint}))
        previous = folder.with_name(folder.name + ".previous")
        if folder.exists():
            folder.rename(previous)
        staging.rename(folder)
        shutil.rmtree(previous, ignore_errors=True)

    def load_checkpoint(self, folder: Path, fingerprint: dict[str, Any]) -> None:
        state = json.loads((folder / "state.json").read_text())
        changed = [k for k in fingerprint if state["fingerprint"].get(k) != fingerprint[k]]
        if changed:
            raise ResumeError(
                f"{folder} was made with different {', '.join(changed)}: resume with the same data and "
                "settings, or start a new run in another --out folder"
            )
        self.master.load_weights(list(mx.load(str(folder / "weights.safetensors")).items()), strict=True)
        if self.master is not self.drafter:
            self.drafter.update(cast_parameters(self.master, self.dtype))
        saved = mx.load(str(folder / "optimizer.safetensors"))
        # leaf by leaf into the live tree: it keeps the empty subtrees a flat file cannot hold,
        # and a compiled update holds on to this very dict
        self.optimizer.state.update(tree_map_with_path(lambda path, _: saved[path], self.optimizer.state))
        mx.eval(self.master.parameters(), self.drafter.parameters(), self.optimizer.state)
        self.step = int(state["step"])


def _float32_copy(drafter: DFlashDrafter) -> DFlashDrafter:
    master = DFlashDrafter(drafter.args)
    master.update(cast_parameters(drafter, mx.float32))
    return master
